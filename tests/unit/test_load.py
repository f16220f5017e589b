"""The lockstep driver (benchmarks/bench_e2e.py --load lockstep), without an engine."""

import pytest

from vllm_dflash2.tools.bench.load import ExcludingClock, lockstep


class _Timer:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Load:
    """Each step takes ``cost`` seconds of the fake timer and yields ``tokens``."""

    def __init__(self, name, timer, cost, tokens, calls):
        self.name, self.timer, self.cost, self.tokens, self.calls = name, timer, cost, tokens, calls

    def step(self):
        self.calls.append(self.name)
        self.timer.now += self.cost
        return self.tokens


def test_lockstep_steps_in_turn_and_clocks_leave_out_the_others():
    timer, calls = _Timer(), []
    loads = {"a": _Load("a", timer, 0.5, 1, calls), "b": _Load("b", timer, 0.25, 3, calls)}
    clocks = {"b": ExcludingClock(timer)}
    got = lockstep(loads, 4, clocks, timer=timer)
    assert got == {"a": (4, 2.0), "b": (12, 1.0)}
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # each round starts one on
    # b's clock advanced by b's own steps only: 3 s passed, 2 s of them a's.
    assert clocks["b"].excluded == pytest.approx(2.0)
    assert clocks["b"]() == pytest.approx(100.0 + 1.0)


def test_lockstep_gives_every_load_every_place():
    timer, calls = _Timer(), []
    loads = {n: _Load(n, timer, 0.1, 1, calls) for n in "abc"}
    lockstep(loads, 3, timer=timer)
    assert calls == list("abc" "bca" "cab")  # no load twice in a row, each in every place


def test_lockstep_needs_a_step():
    with pytest.raises(ValueError, match="steps=0"):
        lockstep({}, 0)
