"""proposer.FailSafe and DFlash2Proposer._drop_poisoned without an engine: which rows
count as poisoned, what the runner gets back, the counters, the warnings and the stop
(tests/e2e/test_poisoned_drafter.py runs the same through a live engine)."""

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash2 import envs
from vllm_dflash2.adaptive import AdaptiveDrafting
from vllm_dflash2.proposer import DFlash2Proposer, FailSafe

NAN, INF = float("nan"), float("inf")


def test_finite_rows_flags_nan_and_plus_inf_logits_and_non_finite_q():
    logits = torch.zeros(4, 3, 2)  # [requests, K, candidates]
    logits[1, 2, 0] = NAN
    logits[2, 0, 1] = INF
    logits[3, 1, 1] = -INF  # a candidate that cannot be drawn: allowed
    assert FailSafe.finite_rows(4, logits, None).tolist() == [True, False, False, True]
    q = torch.full((4 * 3, 2), 0.5)
    q[0, 0] = NAN  # request 0's first row
    assert FailSafe.finite_rows(4, logits, q).tolist() == [False, False, False, True]
    q[0, 0] = -INF
    assert FailSafe.finite_rows(4, None, q).tolist() == [False, True, True, True]
    assert FailSafe.finite_rows(4, None, None) is None


def _proposer(ok, *, k=3, async_scheduling=False, probs=True, max_steps=8, adaptive=None):
    proposer = DFlash2Proposer.__new__(DFlash2Proposer)  # no engine: only what the guard uses
    n = len(ok)
    proposer.device = torch.device("cpu")
    proposer.num_speculative_tokens = k
    proposer._runner = SimpleNamespace(use_async_scheduling=async_scheduling)
    proposer.adaptive = adaptive
    proposer.fail_safe = FailSafe(max_steps)
    proposer._drafted = True
    proposer._draft_ok = torch.tensor(ok)
    proposer._last_draft_probs = torch.full((n, k, 5), NAN) if probs else None
    drafts = torch.arange(n * k).view(n, k)
    return proposer, drafts


def test_clean_step_returns_the_drafts_untouched():
    proposer, drafts = _proposer([True, True])
    assert proposer._drop_poisoned(drafts) is drafts
    assert proposer.fail_safe.stats() == {"poisoned_steps": 0, "dropped_requests": 0,
                                          "consecutive": 0, "stopped": False}
    assert proposer._draft_ok is None
    # No check this step (greedy plain DFlash drafts): nothing counted either way.
    assert proposer._drop_poisoned(drafts) is drafts


def test_affected_requests_get_no_drafts_and_their_q_is_never_handed_on():
    proposer, drafts = _proposer([True, False, True])
    got = proposer._drop_poisoned(drafts)
    assert got == [[0, 1, 2], [], [6, 7, 8]]  # per-request lists, as the runner takes them
    probs = proposer._last_draft_probs
    assert torch.equal(probs[1], torch.zeros(3, 5))
    assert probs[0].isnan().all() and probs[2].isnan().all()  # rows the sampler reads: as given
    assert proposer.fail_safe.stats() == {"poisoned_steps": 1, "dropped_requests": 1,
                                          "consecutive": 1, "stopped": False}


@pytest.mark.parametrize("ok,async_scheduling", [([False, False], False), ([True, False], True)])
def test_whole_step_drafts_nothing_when_all_affected_or_async(ok, async_scheduling):
    """Like adaptive k = 0: a [batch, 0] tensor and no draft probs."""
    proposer, drafts = _proposer(ok, async_scheduling=async_scheduling)
    got = proposer._drop_poisoned(drafts)
    assert isinstance(got, torch.Tensor) and got.shape == (2, 0)
    assert proposer._last_draft_probs is None and proposer.num_speculative_tokens == 0
    assert not proposer._drafted


def test_warnings_rate_limited_and_one_stop_after_max_steps_in_a_row(caplog):
    safe = FailSafe(max_steps=5)
    with caplog.at_level(logging.WARNING, logger="vllm_dflash2.proposer"):
        for _ in range(3):
            safe.poisoned_step(1, 4)
        safe.clean_step()  # a clean drafting step resets the run
        for _ in range(4):
            safe.poisoned_step(2, 4)
        assert not safe.stopped
        safe.poisoned_step(2, 4)
        assert safe.stopped
        for _ in range(3):
            safe.poisoned_step(2, 4)
    messages = [r.getMessage() for r in caplog.records]
    drops = [m for m in messages if "drafts this step were dropped" in m]
    stops = [m for m in messages if "drafting STOPPED" in m]
    assert len(drops) == 4  # steps 1, 2, 4, 8 of 11
    assert len(stops) == 1 and "VLLM_DFLASH2_MAX_POISONED_STEPS=5" in stops[0]
    assert safe.stats() == {"poisoned_steps": 11, "dropped_requests": 3 + 2 * 8,
                            "consecutive": 8, "stopped": True}
    never = FailSafe(max_steps=0)
    for _ in range(100):
        never.poisoned_step(1, 1)
    assert not never.stopped


def test_stopped_proposer_drafts_nothing():
    proposer, _ = _proposer([True])
    proposer.fail_safe.stopped = True
    proposer._draft_ok = None
    cad = SimpleNamespace(batch_size=lambda: 3)
    got = proposer.propose(7, None, None, None, None, None, cad, None)
    assert got.shape == (3, 0) and proposer._last_draft_probs is None


def test_adaptive_does_not_measure_a_dropped_proposal():
    adaptive = AdaptiveDrafting(7)
    adaptive._k_prev, adaptive._t_prev = 7, 1.0
    proposer, drafts = _proposer([False, True], adaptive=adaptive)
    proposer._drop_poisoned(drafts)
    assert adaptive._k_prev == 0 and adaptive._t_prev is None


def test_max_poisoned_steps_variable(monkeypatch):
    monkeypatch.delenv("VLLM_DFLASH2_MAX_POISONED_STEPS", raising=False)
    assert envs.get("VLLM_DFLASH2_MAX_POISONED_STEPS") == 8
    monkeypatch.setenv("VLLM_DFLASH2_MAX_POISONED_STEPS", "0")
    assert envs.get("VLLM_DFLASH2_MAX_POISONED_STEPS") == 0
    monkeypatch.setenv("VLLM_DFLASH2_MAX_POISONED_STEPS", "-2")
    with pytest.raises(ValueError, match="VLLM_DFLASH2_MAX_POISONED_STEPS='-2': expected"):
        envs.get("VLLM_DFLASH2_MAX_POISONED_STEPS")
