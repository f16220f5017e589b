"""The lockstep driver (benchmarks/bench_e2e.py --load lockstep, the demo), without an engine."""

from types import SimpleNamespace

import pytest

from vllm_dflash2.tools.bench.load import ExcludingClock, SustainedLoad, in_turn, lockstep


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


class _Engine:
    """A fake ``LLMEngine``: request ``i`` of prompt ``p`` yields one token a step and
    finishes after ``len(p)`` steps; each step serves every request in it."""

    def __init__(self):
        self.running = {}  # request id -> (prompt, tokens so far)

    def has_unfinished_requests(self):
        return bool(self.running)

    def get_num_unfinished_requests(self):
        return len(self.running)

    def add_request(self, rid, prompt, params):
        self.running[rid] = (prompt, [])

    def step(self):
        outs = []
        for rid, (prompt, toks) in list(self.running.items()):
            toks.append(prompt[len(toks)])
            done = len(toks) == len(prompt)
            if done:
                del self.running[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[
                SimpleNamespace(token_ids=list(toks), logprobs=[{}] * len(toks) if done else None)]))
        return outs


def _load(prompts, c, total):
    return SustainedLoad(SimpleNamespace(llm_engine=_Engine()), prompts, lambda: None, c, total=total)


def test_a_load_with_a_total_adds_that_many_and_keeps_their_order():
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    load = _load(prompts, 2, total=4)
    steps = 0
    while not load.done:
        load.step()
        steps += 1
    assert load.finished_in_order() == prompts  # in the prompts' order, not finishing order
    assert len(load.emitted) == 4 and len(load.logprobs) == 4
    # [4] ends at step 1, [5, 6] runs in steps 2-3, [1, 2, 3] ends at 3, [7..10] runs in 4-7
    assert steps == 7
    assert (load.lo, load.hi) == (1, 2)


def test_in_turn_runs_each_load_to_its_end_and_drops_it_from_the_turn():
    timer = _Timer()
    short, long_ = _load([[1, 2]], 1, total=1), _load([[1, 2, 3, 4]], 1, total=1)
    calls = []
    for name, load in (("short", short), ("long", long_)):
        step = load.step
        load.step = lambda step=step, name=name: (calls.append(name), step())[1]
    got = in_turn({"short": short, "long": long_}, timer=timer)
    assert calls == ["short", "long", "long", "short", "long", "long"]
    assert got["short"][0] == 2 and got["long"][0] == 4
    assert short.finished_in_order() == [[1, 2]] and long_.finished_in_order() == [[1, 2, 3, 4]]


def test_in_turn_needs_finite_loads():
    with pytest.raises(ValueError, match="needs a total"):
        in_turn({"a": _load([[1]], 1, total=None)})
    with pytest.raises(ValueError, match="total=0"):
        _load([[1]], 1, total=0)
