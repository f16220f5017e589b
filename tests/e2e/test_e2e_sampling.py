"""Sampling stays lossless with DFlash2 drafts: a two-sample test against no speculation.

A tiny target with a peaked next-token distribution and a drafter that shares its
embedding/lm_head (``build_peaked_drafter``), so drafts are accepted often (about half
of all draft tokens at temperature 1). N seeded requests of K+1 tokens each, with and
without speculation, for temperature 1 and for temperature 1 with top-p 0.9 / top-k 20.
Token positions 2..K+1 of every request are the ones speculation produces. Per position a
chi-square test of homogeneity compares the two token histograms (tokens seen fewer than
10 times in both samples pooled into one cell); the family of K tests rejects at
ALPHA = 0.01 (Bonferroni: each position at ALPHA / K). Under the null (speculation
lossless) the test passes with probability >= 0.99; the seeds are fixed, so the outcome
is reproducible.

The test must be able to fail: the same statistic has to reject a deliberately wrong q
(``helpers.probes.install_uniform_q``: drafts still drawn from the walk's q, but q reported to
the rejection sampler as uniform over the candidates). Measured on this setup, N=1000
already gives wrong-q p-values below 1e-11 at every position, so N=2000 has a wide
margin both ways.
"""

from collections import Counter

import pytest

from helpers import probes

pytestmark = pytest.mark.e2e

K = 7
N = 2000
ALPHA = 0.01  # family-wise, over the K positions
PROMPT = [11, 57, 203, 19, 88, 140, 7, 300]
PARAMS = [
    {"temperature": 1.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 20},
]
PARAM_IDS = ["t1", "t1-topp0.9-topk20"]


def _samples(llm, seed0, n=N, **params):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = [SamplingParams(max_tokens=K + 1, ignore_eos=True, seed=seed0 + i, **params)
          for i in range(n)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * n, sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _p_values(a, b) -> list[float]:
    """Chi-square homogeneity p-value per position 2..K+1 (list index 1..K)."""
    from scipy.stats import chi2_contingency

    pvals = []
    for pos in range(1, K + 1):
        ca, cb = Counter(s[pos] for s in a), Counter(s[pos] for s in b)
        common = sorted(t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10)
        rest_a = len(a) - sum(ca[t] for t in common)
        rest_b = len(b) - sum(cb[t] for t in common)
        table = [[ca[t] for t in common] + [rest_a], [cb[t] for t in common] + [rest_b]]
        if rest_a + rest_b == 0:
            table = [row[:-1] for row in table]
        pvals.append(float(chi2_contingency(table)[1]))
    return pvals


def _spec_counts(llm) -> tuple[float, float]:
    m = probes.metric_values(llm, "vllm:spec_decode")
    return m.get("vllm:spec_decode_num_accepted_tokens", 0), m.get(
        "vllm:spec_decode_num_draft_tokens", 0)


@pytest.fixture(scope="module")
def reference(peaked_plain):
    """No-speculation samples, one set per parameter setting."""
    return {pid: _samples(peaked_plain, 10_000, **params) for pid, params in zip(PARAM_IDS, PARAMS)}


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_sampled_distribution_matches_no_speculation(peaked_spec, reference, params, request):
    want = reference[request.node.callspec.id]
    acc0, drafted0 = _spec_counts(peaked_spec)
    got = _samples(peaked_spec, 50_000, **params)
    acc1, drafted1 = _spec_counts(peaked_spec)
    acceptance = (acc1 - acc0) / max(drafted1 - drafted0, 1)
    print(f"acceptance {acceptance:.3f} over {drafted1 - drafted0:.0f} draft tokens")
    # Drafts were actually accepted often, or this test would prove nothing.
    assert acceptance > 0.3, acceptance
    assert all(len(s) == K + 1 for s in got)
    pvals = _p_values(got, want)
    print("p-values per position 2..K+1:", [round(p, 4) for p in pvals])
    assert min(pvals) > ALPHA / K, pvals
    # Fixed seeds give identical output run to run.
    assert _samples(peaked_spec, 50_000, n=200, **params) == got[:200]


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_wrong_q_is_detected(peaked_spec, reference, params, request):
    """The statistic above rejects a speculative engine that reports a wrong q."""
    want = reference[request.node.callspec.id]
    assert peaked_spec.collective_rpc(probes.install_uniform_q) == [True]
    try:
        got = _samples(peaked_spec, 50_000, **params)
    finally:
        assert peaked_spec.collective_rpc(probes.install_uniform_q, args=(False,)) == [False]
    pvals = _p_values(got, want)
    print("p-values per position 2..K+1 (wrong q):", [float(f"{p:.3g}") for p in pvals])
    assert min(pvals) < ALPHA / K, pvals
    # With the sabotage removed the engine is correct again (the shared engine is reused).
    again = _samples(peaked_spec, 50_000, n=N, **params)
    assert min(_p_values(again, want)) > ALPHA / K
