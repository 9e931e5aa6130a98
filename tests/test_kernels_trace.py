"""kernels/trace.py: armed buffers go to the next launches in order, once each; unarmed launches
get nothing (so they compile without TRACE). The stamps themselves are inline PTX (%globaltimer):
evals/batch1_trace.py reads them on a GPU."""

import importlib

import torch

trace = importlib.import_module("hf_paged.kernels.trace")


def test_armed_buffers_go_to_the_next_launches_in_order_once():
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    assert trace.take() == {}
    trace.arm(a, b)
    first, second = trace.take(), trace.take()
    assert first["TRACE"] and first["trace_ptr"] is a
    assert second["TRACE"] and second["trace_ptr"] is b
    assert trace.take() == {}


def test_unarmed_kernel_launches_take_nothing():
    from hf_paged.kernels import fused_gemv

    x, w = torch.randn(1, 64), torch.randn(16, 64)
    y = fused_gemv(x, w)
    torch.testing.assert_close(y, x @ w.T)
    assert trace.take() == {}
