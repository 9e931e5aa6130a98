"""The kernels' host-side integer helpers give triton's values (kernels/host_math.py)."""

import triton
from hf_paged.kernels.host_math import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 257):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    for n in (2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
