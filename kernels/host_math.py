"""Integer helpers for the kernels' host-side launch code.

triton.cdiv and triton.next_power_of_2 are constexpr functions (callable in kernels too): on the
host each call unwraps its arguments through Triton's machinery, ~3-5 us, and a launcher makes
several. An eager prefill step launches thousands of kernels, so these plain versions keep that
time off the step (the same values: tests/test_kernels_host_math.py).
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2 gives for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
