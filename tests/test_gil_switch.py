"""The process's one holder of the GIL switch interval (hf_paged/gil_switch.py): users that
overlap in any order (a server's engine loop, grammar helper jobs) leave what was there before
the first of them."""

from __future__ import annotations

import sys

import pytest

from hf_paged.gil_switch import switch_interval


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_shortest_asked_holds_and_the_first_value_comes_back(interval):
    switch_interval.acquire(2e-4)  # a server
    assert sys.getswitchinterval() == pytest.approx(2e-4, abs=2e-6)
    switch_interval.acquire(1e-4)  # a grammar job starts
    assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)
    switch_interval.release(2e-4)  # the server stops first: the job's interval stays
    assert sys.getswitchinterval() == pytest.approx(1e-4, abs=2e-6)
    switch_interval.acquire(2e-4)
    switch_interval.release(1e-4)  # the job ends: the server's comes back
    assert sys.getswitchinterval() == pytest.approx(2e-4, abs=2e-6)
    switch_interval.release(2e-4)
    assert sys.getswitchinterval() == interval


def test_never_longer_than_what_was_there(interval):
    # (Python keeps the interval in whole microseconds: approx)
    sys.setswitchinterval(5e-5)
    switch_interval.acquire(2e-4)
    assert sys.getswitchinterval() == pytest.approx(5e-5, abs=2e-6)
    switch_interval.release(2e-4)
    assert sys.getswitchinterval() == pytest.approx(5e-5, abs=2e-6)
