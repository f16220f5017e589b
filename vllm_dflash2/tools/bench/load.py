"""Sustained load on an offline engine: ``c`` requests in flight until a token budget is out.

``LLM.generate`` on ``c`` prompts times one wave: with speculation its requests finish
apart (each advances by its own accepted drafts) and the last ones run on at a smaller
batch, so the wave measures its slowest request, not c-way throughput. A loaded server
refills instead: a finished request's slot goes to the next one in its queue. This drives
the engine's own request loop the same way, for ``benchmarks/bench_e2e.py``; ``lockstep``
drives several engines of one process a step each in turn (``--load lockstep``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

_ids = itertools.count()


@dataclass
class SustainedRun:
    tokens: int  # output tokens produced inside the timed window
    seconds: float
    started: int  # requests added
    finished: int  # requests that ran to the end inside the window
    in_flight: tuple[int, int]  # fewest and most unfinished requests the engine held at a step


class SustainedLoad:
    """``concurrency`` requests kept in one engine: each ``step()`` runs one engine step
    and replaces the requests it finished before returning.

    ``prompts`` cycle from index ``first`` (anything ``LLMEngine.add_request`` takes, e.g.
    token-id prompts; loads that should see different prompts pass different ``first``);
    ``make_params()`` gives each request its ``SamplingParams``. With ``total``, only that
    many requests are ever added, and the load is ``done`` once they have all finished.
    """

    def __init__(self, llm, prompts: list, make_params: Callable, concurrency: int,
                 first: int = 0, total: int | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}: expected >= 1")
        if not prompts:
            raise ValueError("prompts: expected at least one prompt, got none")
        if total is not None and total < 1:
            raise ValueError(f"total={total}: expected >= 1 or None")
        self.engine = llm.llm_engine
        if self.engine.has_unfinished_requests():
            raise RuntimeError("SustainedLoad: the engine already has unfinished requests")
        self._prompts, self._make_params, self._first = prompts, make_params, first
        self.total = total
        self.emitted: dict[str, int] = {}  # request id -> output tokens so far, in added order
        self.outputs: dict[str, list[int]] = {}  # finished request id -> its tokens
        self.logprobs: dict[str, list] = {}  # finished request id -> its logprobs, where asked
        self.lo, self.hi = concurrency, 0  # fewest and most unfinished requests at a step
        for _ in range(concurrency if total is None else min(concurrency, total)):
            self._add()

    @property
    def done(self) -> bool:
        return self.total is not None and len(self.outputs) == self.total

    def finished_in_order(self) -> list[list[int]]:
        """The finished requests' tokens in the order they were added (i.e. of the prompts
        from ``first``)."""
        return [self.outputs[r] for r in self.emitted if r in self.outputs]

    def _add(self) -> None:
        rid = f"sustained-{next(_ids)}"
        n = len(self.emitted)
        self.engine.add_request(rid, self._prompts[(self._first + n) % len(self._prompts)],
                                self._make_params())
        self.emitted[rid] = 0

    def step(self) -> int:
        """One engine step; returns the output tokens it produced."""
        held = self.engine.get_num_unfinished_requests()
        self.lo, self.hi = min(self.lo, held), max(self.hi, held)
        new = 0
        for out in self.engine.step():
            n = len(out.outputs[0].token_ids)
            new += n - self.emitted[out.request_id]
            self.emitted[out.request_id] = n
            if out.finished:
                self.outputs[out.request_id] = list(out.outputs[0].token_ids)
                if out.outputs[0].logprobs is not None:
                    self.logprobs[out.request_id] = out.outputs[0].logprobs
                if self.total is None or len(self.emitted) < self.total:
                    self._add()
        return new

    def stop(self) -> None:
        """Abort the requests still running and drain them: the engine is idle on return."""
        self.engine.abort_request([r for r in self.emitted if r not in self.outputs])
        while self.engine.has_unfinished_requests():
            self.engine.step()


def sustained(llm, prompts: list, make_params: Callable, concurrency: int,
              budget: int, first: int = 0) -> SustainedRun:
    """Keep ``concurrency`` requests in the engine until ``budget`` output tokens are out
    (``SustainedLoad``). The clock stops at the step that reaches the budget; the requests
    still running then are aborted and drained untimed, so the engine is idle on return.
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: expected >= 1")
    start = time.perf_counter()
    load = SustainedLoad(llm, prompts, make_params, concurrency, first)
    total = 0
    while total < budget:
        total += load.step()
    seconds = time.perf_counter() - start
    load.stop()
    return SustainedRun(total, seconds, len(load.emitted), len(load.outputs), (load.lo, load.hi))


# -- lockstep: several engines of one process, one step each in turn -----------------
# Measured one after the other, two engines' runs of a point lie seconds to minutes
# apart, and on a shared machine their per-round ratios spread by 10-40%. Stepped in
# turn, each engine's step lies a step away from the other's, so slow spells land on
# both alike; the ratios of blocks of steps are then what to read.

class ExcludingClock:
    """``time.perf_counter`` less the time other engines' steps took (``exclude``): an
    adaptive controller stepped in lockstep with other engines times its own steps only
    (``profiling.install_clock`` gives it to a proposer)."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self._timer = timer
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def __call__(self) -> float:
        return self._timer() - self.excluded


def lockstep(loads: dict, steps: int, clocks: dict | None = None,
             timer: Callable[[], float] = time.perf_counter) -> dict[str, tuple[int, float]]:
    """``steps`` rounds of one ``step()`` of every load, in turn. Round i starts at load
    i mod n of ``loads`` and goes on in its order, so every load takes every place equally
    often and none steps twice in a row. Returns each load's (tokens, seconds) over those
    steps. ``clocks[name]``, where given, is told to leave out every other load's steps."""
    if steps < 1:
        raise ValueError(f"steps={steps}: expected >= 1")
    tally = _Tally(loads, clocks or {}, timer)
    for i in range(steps):
        tally.round(i, list(loads))
    return tally.result()


def in_turn(loads: dict, clocks: dict | None = None,
            timer: Callable[[], float] = time.perf_counter) -> dict[str, tuple[int, float]]:
    """``lockstep`` until every load (each with a ``total``) is ``done``: a load that is
    done drops out of the turn, the others go on. Returns each load's (tokens, seconds)."""
    if any(load.total is None for load in loads.values()):
        raise ValueError("in_turn: every load needs a total (SustainedLoad(..., total=N))")
    tally = _Tally(loads, clocks or {}, timer)
    i = 0
    while names := [n for n, load in loads.items() if not load.done]:
        tally.round(i, names)
        i += 1
    return tally.result()


class _Tally:
    """Each load's tokens and seconds over the rounds of ``lockstep`` and ``in_turn``;
    ``round(i, names)`` steps each of ``names`` once, starting at the i-th."""

    def __init__(self, loads: dict, clocks: dict, timer: Callable[[], float]):
        self.loads, self.clocks, self.timer = loads, clocks, timer
        self.tokens = dict.fromkeys(loads, 0)
        self.seconds = dict.fromkeys(loads, 0.0)

    def round(self, i: int, names: list[str]) -> None:
        first = i % len(names) if names else 0
        for name in names[first:] + names[:first]:
            t0 = self.timer()
            self.tokens[name] += self.loads[name].step()
            dt = self.timer() - t0
            self.seconds[name] += dt
            for other, clock in self.clocks.items():
                if other != name:
                    clock.exclude(dt)

    def result(self) -> dict[str, tuple[int, float]]:
        return {n: (self.tokens[n], self.seconds[n]) for n in self.loads}


def chat_prompts(llm, prompts: list[str]) -> list[dict]:
    """User prompts as token-id prompts, through the tokenizer's chat template (as ``LLM.chat``)."""
    from ...train.prompts import chat_ids

    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": chat_ids(tok, p)} for p in prompts]
