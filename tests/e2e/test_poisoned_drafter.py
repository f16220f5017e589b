"""A drafter that fails safe: non-finite draft logits or q never reach the rejection
sampler (proposer.FailSafe).

The drafter is poisoned inside the live engine (``helpers.fail_safe``): NaN in its final
norm weight, as a half-trained or badly quantized drafter would hold, so every draft logit
and q is NaN; or NaN draft logits for the requests of one marked prompt only. On the peaked
tiny models (``conftest.peaked_models``, where a healthy drafter's drafts are accepted
often) against the same target without speculation:

* greedy outputs equal plain decoding, every request finishes as asked, no draft of a
  poisoned step is verified, the counters count the poisoned steps, and after
  ``max_steps`` of them in a row drafting stops for the engine (and stays stopped);
* at T = 1 the output distribution is the target's: the chi-square test of
  ``test_e2e_sampling`` (same helpers, prompt, N and alpha) against plain sampling, with the
  stop switched off so that every drafting step is poisoned;
* only the marked requests lose their drafts; the others keep drafting and being accepted.
"""

import gc

import pytest
from test_e2e_sampling import ALPHA, K, PARAMS, _p_values, _samples, _spec_counts

from helpers import fail_safe, probes

pytestmark = pytest.mark.e2e

MARK = 377  # first prompt token of the requests poison_marked_requests poisons


def _prompts():
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids) for ids in
            ([11, 57, 203, 19], [300, 7, 140, 88, 19, 57], [5, 6, 7, 8, 9, 10, 11, 12],
             [240] * 30, [90, 91], [MARK, 12, 13, 14, 15, 16])]


def _greedy(llm):
    from vllm import SamplingParams

    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=32,
                                                   ignore_eos=True), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def spec(peaked_models):
    target, drafter = peaked_models
    llm = probes.tiny_llm(target, drafter, max_model_len=256, env=probes.FIXED_K)
    yield llm
    del llm
    gc.collect()


@pytest.fixture
def healthy_after(spec):
    """Whatever a test poisons, the engine is healthy (and drafting) after it."""
    yield spec
    spec.collective_rpc(fail_safe.poison_drafter, args=(False,))
    spec.collective_rpc(fail_safe.poison_marked_requests, args=(None,))
    spec.collective_rpc(fail_safe.reset_fail_safe, args=(8,))


def test_poisoned_drafter_keeps_greedy_output_and_stops_drafting(peaked_plain, healthy_after):
    spec = healthy_after
    want = _greedy(peaked_plain)
    acc0, drafted0 = _spec_counts(spec)
    assert _greedy(spec) == want
    acc1, drafted1 = _spec_counts(spec)
    assert acc1 - acc0 > 0, "the healthy drafter must get drafts accepted"

    [stats] = spec.collective_rpc(fail_safe.reset_fail_safe, args=(4,))
    assert stats["poisoned_steps"] == 0 and not stats["stopped"]
    assert spec.collective_rpc(fail_safe.poison_drafter) == [True]
    assert _greedy(spec) == want  # every request finishes, with plain decoding's output
    acc2, drafted2 = _spec_counts(spec)
    assert drafted2 == drafted1, "a poisoned draft reached the rejection sampler"
    [stats] = spec.collective_rpc(fail_safe.fail_safe_stats)
    # Every request of every drafting step was poisoned; the 4th step in a row stopped it.
    assert stats["stopped"] and stats["poisoned_steps"] == 4, stats
    assert stats["dropped_requests"] >= 4, stats
    # Stopped: no drafting at all, whatever the drafter does now.
    assert spec.collective_rpc(fail_safe.poison_drafter, args=(False,)) == [False]
    assert _greedy(spec) == want
    assert _spec_counts(spec)[1] == drafted2
    assert spec.collective_rpc(fail_safe.fail_safe_stats) == [stats]


def test_poisoned_q_never_reaches_the_sampler_at_t1(peaked_plain, healthy_after):
    """T = 1, every drafting step poisoned (the stop switched off): the chi-square test of
    test_e2e_sampling against plain sampling holds, and nothing poisoned was verified."""
    spec = healthy_after
    params = PARAMS[0]
    want = _samples(peaked_plain, 10_000, **params)
    spec.collective_rpc(fail_safe.reset_fail_safe, args=(0,))
    assert spec.collective_rpc(fail_safe.poison_drafter) == [True]
    _, drafted0 = _spec_counts(spec)
    got = _samples(spec, 50_000, **params)
    _, drafted1 = _spec_counts(spec)
    [stats] = spec.collective_rpc(fail_safe.fail_safe_stats)
    assert all(len(s) == K + 1 for s in got)  # no request lost
    assert stats["poisoned_steps"] > 0 and not stats["stopped"], stats
    assert drafted1 == drafted0, "a poisoned draft reached the rejection sampler"
    pvals = _p_values(got, want)
    print("p-values per position 2..K+1 (poisoned drafter):", [round(p, 4) for p in pvals])
    assert min(pvals) > ALPHA / K, pvals


def test_only_the_marked_requests_lose_their_drafts(peaked_plain, healthy_after):
    spec = healthy_after
    want = _greedy(peaked_plain)
    spec.collective_rpc(fail_safe.reset_fail_safe, args=(0,))
    assert spec.collective_rpc(fail_safe.poison_marked_requests, args=(MARK,)) == [True]
    acc0, drafted0 = _spec_counts(spec)
    assert _greedy(spec) == want
    acc1, drafted1 = _spec_counts(spec)
    [stats] = spec.collective_rpc(fail_safe.fail_safe_stats)
    # One marked request per drafting step while it runs: its drafts alone were dropped.
    assert stats["poisoned_steps"] > 0 and stats["dropped_requests"] == stats["poisoned_steps"]
    assert not stats["stopped"]
    assert acc1 - acc0 > 0 and drafted1 > drafted0, "the other requests must keep drafting"
