"""Sustained load on an offline engine: ``c`` requests in flight until a token budget is out.

``LLM.generate`` on ``c`` prompts times one wave: with speculation its requests finish
apart (each advances by its own accepted drafts) and the last ones run on at a smaller
batch, so the wave measures its slowest request, not c-way throughput. A loaded server
refills instead: a finished request's slot goes to the next one in its queue. This drives
the engine's own request loop the same way, for ``benchmarks/bench_e2e.py``.
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


def sustained(llm, prompts: list, make_params: Callable, concurrency: int,
              budget: int, first: int = 0) -> SustainedRun:
    """Keep ``concurrency`` requests in the engine until ``budget`` output tokens are out.

    ``prompts`` cycle from index ``first`` (anything ``LLMEngine.add_request`` takes, e.g.
    token-id prompts; runs that should see different prompts pass different ``first``);
    ``make_params()`` gives each request its ``SamplingParams``. A finished request is
    replaced before the next engine step. The clock stops at the step that reaches the
    budget; the requests still running then are aborted and drained untimed, so the
    engine is idle again on return.
    """
    if concurrency < 1 or budget < 1:
        raise ValueError(f"concurrency={concurrency}, budget={budget}: expected both >= 1")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("sustained: the engine already has unfinished requests")
    emitted: dict[str, int] = {}  # request id -> output tokens so far
    done: set[str] = set()

    def add() -> None:
        rid = f"sustained-{next(_ids)}"
        engine.add_request(rid, prompts[(first + len(emitted)) % len(prompts)], make_params())
        emitted[rid] = 0

    lo, hi = concurrency, 0
    start = time.perf_counter()
    for _ in range(concurrency):
        add()
    total = 0
    while total < budget:
        held = engine.get_num_unfinished_requests()
        lo, hi = min(lo, held), max(hi, held)
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            total += n - emitted[out.request_id]
            emitted[out.request_id] = n
            if out.finished:
                done.add(out.request_id)
                add()
    seconds = time.perf_counter() - start
    engine.abort_request([r for r in emitted if r not in done])
    while engine.has_unfinished_requests():
        engine.step()
    return SustainedRun(total, seconds, len(emitted), len(done), (lo, hi))


def chat_prompts(llm, prompts: list[str]) -> list[dict]:
    """User prompts as token-id prompts, through the tokenizer's chat template (as ``LLM.chat``)."""
    from .train.data import chat_ids

    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": chat_ids(tok, p)} for p in prompts]
