"""Adaptive speculation: the controller's decisions (tests/e2e/test_adaptive_engine.py:
a real engine running it)."""

import pytest

from vllm_dflash2.adaptive import ENV, AdaptiveSpeculation, bucket, enabled_from_env

STEP_RECORD_ENV = "VLLM_DFLASH2_STEP_RECORD"

K = 7


def _feed(ctl, batch, cost_of_k, accept_prob, steps=200):
    """Drive the controller like the proposer does: choose, then observe that step."""
    chosen = []
    for _ in range(steps):
        k = ctl.choose(batch, K)
        chosen.append(k)
        ctl.observe_step(batch, k, cost_of_k(k))
        if k:
            # accepted drafts per request: first i accepted with prob accept_prob**i
            n_req = 100
            accepted = []
            for r in range(n_req):
                a = 0
                while a < k and (r * 7919 + a * 104729) % 1000 < 1000 * accept_prob:
                    a += 1
                accepted.append(a)
            ctl.observe_acceptance(k, accepted)
    return chosen


def _mode(xs):
    tail = xs[len(xs) // 2:]
    return max(set(tail), key=tail.count)


def test_no_acceptance_turns_speculation_off():
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 1, lambda k: 0.07 + 0.01 * k, accept_prob=0.0)
    # A new batch size measures plain decoding, then full speculation twice (the first
    # step may pay one-off set-up), then none.
    assert chosen[:6] == [0, 0, 0, K, K, 0]
    assert _mode(chosen) == 0
    assert ctl.expected_tokens(K) == pytest.approx(1.0, abs=0.02)  # prior pseudo-trial left


def test_full_k_is_tried_twice_even_if_those_steps_are_not_measured():
    # Batch sizes passed through while a burst of requests is prefilled: their steps carry
    # prefill chunks and are not measured. Plain decoding is measured first, so those
    # never try full K (served, c = 16: batch 5-8 tried it twice at 2.9 plain steps).
    ctl = AdaptiveSpeculation(K)
    assert [ctl.choose(6, K) for _ in range(20)] == [0] * 20
    for _ in range(3):
        ctl.observe_step(6, 0, 0.07)
    # Then full K twice, measured or not ("full K not measured yet" stays true), and only
    # twice: a batch size passed through again would otherwise try it with every burst.
    assert [ctl.choose(6, K) for _ in range(2)] == [K, K]
    assert [ctl.choose(6, K) for _ in range(12)] == [0] * 12  # until the first probe
    # Measured plain steps, high acceptance, cheap drafts: k climbs from the probes.
    chosen = _feed(ctl, 6, lambda k: 0.07 + 0.002 * k, accept_prob=0.95, steps=400)
    assert _mode(chosen) == K


def test_high_acceptance_and_cheap_drafts_use_full_k():
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 1, lambda k: 0.07 + 0.002 * k, accept_prob=0.95)
    assert _mode(chosen) == K


def test_costly_verification_picks_a_short_draft():
    # Acceptance ~0.6 per position, each extra draft costs 25% of a plain step.
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 1, lambda k: 0.08 * (1 + 0.25 * k), accept_prob=0.6)
    best = _mode(chosen)
    assert 0 < best < K
    rates = {k: ctl.expected_tokens(k) / (0.08 * (1 + 0.25 * k)) for k in range(K + 1)}
    assert rates[best] >= 0.9 * max(rates.values())


def test_batch_sizes_are_decided_separately():
    ctl = AdaptiveSpeculation(K)
    _feed(ctl, 1, lambda k: 0.07 + 0.002 * k, accept_prob=0.8)
    # At batch 8 verification is compute-bound: every draft row costs a plain step.
    chosen = _feed(ctl, 8, lambda k: 0.2 * (1 + k), accept_prob=0.8)
    assert bucket(1) != bucket(8)
    assert _mode(chosen) == 0
    assert ctl.choose(1, K) > 0


def test_marginal_gain_and_cost_spikes_keep_plain_decoding():
    # Drafting one token gains ~5% on paper (below min_gain), and every 5th step the
    # machine stalls (3x): neither may lure the controller away from plain decoding.
    ctl = AdaptiveSpeculation(K)
    n = iter(range(10**6))
    chosen = _feed(ctl, 16, lambda k: (0.1 + 0.004 * k) * (3 if next(n) % 5 == 0 else 1),
                   accept_prob=0.1)
    tail = chosen[len(chosen) // 2:]
    assert tail.count(0) >= 0.9 * len(tail)  # the rest is exploration of k = 1
    assert ctl.estimated_cost(16, 0) == pytest.approx(0.1)  # median, not the spikes


def test_a_clear_gain_is_taken_despite_cost_spikes():
    ctl = AdaptiveSpeculation(K)
    n = iter(range(10**6))
    chosen = _feed(ctl, 1, lambda k: (0.07 + 0.004 * k) * (3 if next(n) % 5 == 0 else 1),
                   accept_prob=0.6)
    assert _mode(chosen) > 0


def test_idle_gaps_are_not_step_costs():
    ctl = AdaptiveSpeculation(K)
    ctl.observe_step(1, 3, 0.1)
    ctl.observe_step(1, 3, 30.0)  # the engine waited for a request
    assert ctl.estimated_cost(1, 3) == pytest.approx(0.1)


def test_scheduler_limit_is_respected():
    ctl = AdaptiveSpeculation(K)
    assert all(ctl.choose(1, 2) <= 2 for _ in range(50))
    assert ctl.choose(1, 0) == 0


def test_env_switch(monkeypatch):
    monkeypatch.setenv(ENV, "off")
    assert enabled_from_env() is False
    monkeypatch.setenv(ENV, "1")
    assert enabled_from_env() is True
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=f"{ENV}='maybe'.*expected"):
        enabled_from_env()


def test_step_record_length_is_checked(monkeypatch):
    from vllm_dflash2 import envs

    monkeypatch.delenv(STEP_RECORD_ENV, raising=False)
    assert envs.get(STEP_RECORD_ENV) == 0
    monkeypatch.setenv(STEP_RECORD_ENV, "500")
    assert envs.get(STEP_RECORD_ENV) == 500
    for bad in ("-1", "lots"):
        monkeypatch.setenv(STEP_RECORD_ENV, bad)
        with pytest.raises(ValueError, match=f"{STEP_RECORD_ENV}='{bad}'.*expected"):
            envs.get(STEP_RECORD_ENV)


def test_default_depends_on_the_backend(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert enabled_from_env(default=True) is True
    assert enabled_from_env(default=False) is False


def _probe_gaps(chosen):
    probes = [i for i, k in enumerate(chosen[2:], 2) if k != 0]
    return [b - a for a, b in zip(probes, probes[1:])]


def test_probes_back_off_while_the_choice_holds():
    # Batch 4: a draft row costs half a plain step (full acceptance would pay), nothing
    # is accepted.
    ctl = AdaptiveSpeculation(K, explore_every=16, explore_max=128)
    gaps = _probe_gaps(_feed(ctl, 4, lambda k: 0.1 * (1 + 0.5 * k), accept_prob=0.0, steps=2000))
    assert len(gaps) <= 20  # gaps 16, 32, 64, 128, 128, ...: not one step in 16
    assert gaps == sorted(gaps) and gaps[-1] == 128


def test_probes_back_off_further_where_drafting_cannot_pay_at_all():
    # Batch 16, compute-bound: every draft row costs a plain step, so even full acceptance
    # gives (1 + k) tokens for (1 + k) steps' cost.
    ctl = AdaptiveSpeculation(K, explore_every=16, explore_max=128)
    gaps = _probe_gaps(_feed(ctl, 16, lambda k: 0.1 * (1 + k), accept_prob=1.0, steps=5000))
    assert gaps == sorted(gaps) and gaps[-1] == 8 * 128
    assert len(gaps) <= 10
    # A larger batch size takes the verdict of this one from its first probe on: no
    # probe in its first 128 steps of plain decoding, none 16 or 32 steps apart.
    chosen = _feed(ctl, 32, lambda k: 0.2 * (1 + 1.2 * k), accept_prob=1.0, steps=2000)
    assert chosen[:3] == [0, 0, 0] and not any(chosen[:128])
    gaps = _probe_gaps(chosen)
    assert gaps == sorted(gaps) and gaps[0] >= 128 and gaps[-1] > 128


def test_probes_still_find_acceptance_that_appears_later():
    cost = lambda k: 0.07 + 0.004 * k  # noqa: E731
    ctl = AdaptiveSpeculation(K, explore_every=16, explore_max=128)
    assert _mode(_feed(ctl, 1, cost, accept_prob=0.0, steps=600)) == 0
    again = _feed(ctl, 1, cost, accept_prob=0.9, steps=1000)
    assert _mode(again) == K


def _stalling(cost, stalled_plain_steps):
    """cost(k), except that the first ``stalled_plain_steps`` plain steps take 3x."""
    left = [stalled_plain_steps]

    def f(k):
        if k == 0 and left[0] > 0:
            left[0] -= 1
            return 3 * cost(k)
        return cost(k)
    return f


def test_one_stalled_plain_step_does_not_start_speculation():
    # Batch 2, drafts do not pay (acceptance 0.3, each draft row +20%); the first plain
    # step the controller measures stalls. Deciding on that one step drafted at a loss.
    cost = lambda k: 0.064 * (1 + 0.2 * k)  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 2, _stalling(cost, 1), accept_prob=0.3, steps=64)
    # The baseline (the stalled first step was replaced by the next one), then full K.
    assert chosen[:6] == [0, 0, 0, 0, K, K]
    assert sum(k > 0 for k in chosen[5:]) <= 3  # probes only


def test_plain_decoding_is_remeasured_while_speculating():
    # The machine was busy while the baseline was measured (3 stalled plain steps), so
    # drafting looked worth it; the baseline probes must find plain decoding again.
    cost = lambda k: 0.064 * (1 + 0.2 * k)  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 2, _stalling(cost, 3), accept_prob=0.3, steps=600)
    assert any(k > 0 for k in chosen[4:40])  # it did start drafting
    tail = chosen[300:]
    assert tail.count(0) >= 0.9 * len(tail)


def test_a_larger_batch_skips_full_speculation_that_cannot_pay():
    # At batch 2 full K already loses (acceptance 0.3); verification is only more
    # compute-bound at batch 16, where one K = 7 step would cost 8 plain steps.
    ctl = AdaptiveSpeculation(K)
    assert _mode(_feed(ctl, 2, lambda k: 0.064 * (1 + 0.2 * k), accept_prob=0.3)) == 0
    chosen = _feed(ctl, 16, lambda k: 0.1 * (1 + k), accept_prob=0.3, steps=300)
    assert chosen[:3] == [0, 0, 0]
    assert max(chosen) == 1  # probes of one draft only
    assert chosen.count(1) <= 10


def test_a_larger_batch_still_measures_full_speculation_that_may_pay():
    ctl = AdaptiveSpeculation(K)
    _feed(ctl, 1, lambda k: 0.07 + 0.002 * k, accept_prob=0.9)
    assert [ctl.choose(16, K) for _ in range(3)] == [0, 0, 0]
    for _ in range(3):
        ctl.observe_step(16, 0, 0.1)
    assert ctl.choose(16, K) == K


def test_one_cheap_probe_does_not_jump_to_full_speculation():
    # Full K was skipped at batch 4 (batch 2 shows it cannot pay); the first probe of one
    # draft happens to cost no more than a plain step. A straight line through those two
    # points says any k is free, but k may only grow one past the largest k measured.
    ctl = AdaptiveSpeculation(K)
    assert _mode(_feed(ctl, 2, lambda k: 0.064 * (1 + 0.5 * k), accept_prob=0.3)) == 0
    first_probe = [True]

    def cost(k):
        if k == 1 and first_probe[0]:
            first_probe[0] = False
            return 0.1
        return 0.1 * (1 + 0.5 * k)

    chosen = _feed(ctl, 4, cost, accept_prob=0.5, steps=300)
    assert 1 in chosen  # the cheap probe happened
    assert max(chosen) <= 3, chosen


def test_report_counts_match_what_was_chosen_and_measured():
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 4, lambda k: 0.1 * (1 + 0.1 * k), accept_prob=0.5, steps=120)
    snap = ctl.snapshot()
    b = bucket(4)
    assert sum(snap["chosen"][b].values()) == len(chosen)
    assert snap["chosen"][b] == {k: chosen.count(k) for k in set(chosen)}
    for k, ms in snap["mean_ms"][b].items():  # constant cost per k: mean == that cost
        assert ms == pytest.approx(100 * (1 + 0.1 * k))


def _two_ranks(agree: bool, steps: int = 120):
    """Two tensor-parallel ranks' AdaptiveDrafting, each timing its own steps: on rank 0
    drafts are cheap, on rank 1 dear. With ``agree`` rank 1 takes rank 0's k (what the
    proposer's broadcast does). Returns each rank's k per step."""
    from types import SimpleNamespace

    import torch

    from vllm_dflash2.adaptive import AdaptiveDrafting

    shared = {}

    def leader(k):
        shared["k"] = k
        return k

    ranks = []
    for draft_cost, fn in ((0.0001, leader), (0.1, lambda k: shared["k"])):
        drafting = AdaptiveDrafting(K, agree=fn if agree else None)
        now = [0.0]
        drafting.clock = lambda now=now: now[0]
        ranks.append((drafting, now, draft_cost))
    greedy = SimpleNamespace(all_greedy=True, generators={})
    chosen = [[], []]
    for _ in range(steps):
        for i, (drafting, now, draft_cost) in enumerate(ranks):  # rank 0 first, as a broadcast
            k_prev = drafting._k_prev
            now[0] += 0.01 + draft_cost * k_prev  # the step that just ran
            if k_prev:
                drafting.note_verified([k_prev] * 2, torch.tensor([k_prev + 1] * 2))
            cad = SimpleNamespace(batch_size=lambda: 2, max_query_len=1 + k_prev)
            chosen[i].append(drafting.choose(cad, greedy, K))
    return chosen


def test_tensor_parallel_ranks_draft_rank0s_k():
    rank0, rank1 = _two_ranks(agree=False)
    assert rank0 != rank1  # each rank's own timing would choose its own k
    rank0, rank1 = _two_ranks(agree=True)
    assert rank0 == rank1 and any(rank0)


def test_seeded_rows_draft_k_beside_the_others_k():
    """A seeded request drafts K every step (its samples depend on the drafts verified),
    without pinning the rest of the batch: they keep the controller's k, and such a mixed
    step is not measured as a step of either k. A batch of seeded rows only drafts K."""
    from types import SimpleNamespace

    import torch

    from vllm_dflash2.adaptive import AdaptiveDrafting

    drafting = AdaptiveDrafting(K)
    now = [0.0]
    drafting.clock = lambda: now[0]
    cad = SimpleNamespace(batch_size=lambda: 3, max_query_len=1)
    seeded_one = SimpleNamespace(all_greedy=False, generators={1: object()})
    seeded_all = SimpleNamespace(all_greedy=False, generators={0: 1, 1: 1, 2: 1})
    ks = []
    for step in range(40):
        now[0] += 0.01 + 0.02 * (drafting._k_prev > 0)  # drafting never pays here
        k = drafting.choose(cad, seeded_one, K)
        ks.append(k)
        if k < K:
            assert drafting.pinned_rows == [1]
        else:
            assert drafting.pinned_rows == []
        drafting.note_verified([k, K if k < K else k, k], torch.tensor([1, 2, 1]))
    assert 0 in ks, "the unseeded rows never left K"
    measured_ks = {k for costs in drafting.controllers[False].cost.values() for k in costs}
    # Only the one full-K try and uniform steps are measured: never a mixed step as k = 0.
    assert 0 not in measured_ks, measured_ks
    assert drafting.choose(SimpleNamespace(batch_size=lambda: 3, max_query_len=1),
                           seeded_all, K) == K
    assert drafting.pinned_rows == []


def _cold_first_step(cost, cold_seconds):
    """cost(k), except that the first step of each k costs ``cold_seconds`` (one-off set-up
    for new GEMM shapes)."""
    seen = set()

    def f(k):
        if k not in seen:
            seen.add(k)
            return cold_seconds
        return cost(k)
    return f


def test_a_cold_first_step_does_not_rule_out_full_k():
    # Batch 1, bf16 served: the first K = 7 step took 200 ms against ~35 ms after it, and a
    # median of that one step kept K out (and the line through it every k > 2).
    cost = lambda k: 0.025 * (1 + 0.2 * (k > 0) + 0.03 * k)  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 1, _cold_first_step(cost, 0.2), accept_prob=0.9, steps=300)
    assert chosen[:6] == [0, 0, 0, 0, K, K]  # the cold first plain step was replaced too
    assert ctl.cost[0][K] == pytest.approx(cost(K))  # the cold step was replaced
    assert _mode(chosen) >= K - 1, chosen


def test_a_step_after_a_cold_one_that_is_not_cheaper_keeps_both():
    ctl = AdaptiveSpeculation(K)
    ctl.observe_step(1, 3, 0.030)
    ctl.observe_step(1, 3, 0.040)  # a stall after a normal step: not a cold start
    assert list(ctl.samples[0][3]) == [0.030, 0.040]


def test_deferred_context_writes_are_not_step_costs():
    """A probe after a run of plain steps flushes their deferred draft context; steady
    drafting never does, so the flush is left out of the step's cost."""
    from types import SimpleNamespace

    import torch

    from vllm_dflash2.adaptive import AdaptiveDrafting

    drafting = AdaptiveDrafting(K)
    now = [0.0]
    drafting.clock = lambda: now[0]
    greedy = SimpleNamespace(all_greedy=True, generators={})
    k = 0
    for step in range(30):
        flush = 0.02 if step % 5 == 0 else 0.0
        now[0] += 0.03 + 0.002 * k + flush
        if k:
            drafting.note_verified([k], torch.tensor([k + 1]))
        cad = SimpleNamespace(batch_size=lambda: 1, max_query_len=1 + k)
        k = drafting.choose(cad, greedy, K, write_seconds=flush)
    for ks, seconds in drafting.controller.samples[0].items():
        assert all(s == pytest.approx(0.03 + 0.002 * ks) for s in seconds), (ks, seconds)


def test_probes_from_plain_decoding_try_the_best_drafting_k():
    # Batch 1 served: drafting has a large fixed cost (k = 1: 1.5 plain steps), so a probe
    # of one draft never pays and only refreshes the first position's acceptance. At
    # acceptance 0.4 long drafts come within min_gain of plain decoding, one draft not.
    cost = lambda k: 0.025 * (1 + 0.5 * (k > 0) + 0.02 * k)  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    assert _mode(_feed(ctl, 1, cost, accept_prob=0.9, steps=200)) == K
    marginal = _feed(ctl, 1, cost, accept_prob=0.4, steps=600)
    assert _mode(marginal) == 0
    probes = [k for k in marginal[300:] if k]
    assert probes and min(probes) > 1, probes
    back = _feed(ctl, 1, cost, accept_prob=0.9, steps=300)
    assert _mode(back) == K


def test_where_no_drafting_k_may_pay_probes_are_the_cheapest():
    # Batch 16: drafting at all costs 0.8 plain steps, each draft 0.05 more, acceptance
    # 0.3: no k pays, and two or three drafts rate best among the losing ones. A probe
    # there would cost more than one of a single draft and find nothing more.
    cost = lambda k: 0.03 * (1 + 0.8 * (k > 0) + 0.05 * k)  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    chosen = _feed(ctl, 16, cost, accept_prob=0.3, steps=600)
    assert _mode(chosen) == 0
    probes = [k for k in chosen[100:] if k]
    assert probes and set(probes) == {1}, probes


def test_step_log_writes_every_step_and_the_controllers_estimates(monkeypatch, tmp_path):
    """``VLLM_DFLASH2_STEP_LOG``: one JSON line per step as it goes (a served engine's
    record, readable while it runs), and the controllers' estimates every 256 steps."""
    import json
    from types import SimpleNamespace

    import torch

    from vllm_dflash2.adaptive import AdaptiveDrafting

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("VLLM_DFLASH2_STEP_LOG", str(log))
    drafting = AdaptiveDrafting(K)
    rank1 = AdaptiveDrafting(K, rank=1)
    now = [0.0]
    drafting.clock = lambda: now[0]
    greedy = SimpleNamespace(all_greedy=True, generators={})
    k, chosen = 0, []
    for _ in range(300):
        now[0] += 0.03 + 0.002 * k
        if k:
            drafting.note_verified([k, k], torch.tensor([k + 1, 1]))
        k = drafting.choose(SimpleNamespace(batch_size=lambda: 2, max_query_len=1 + k),
                            greedy, K)
        chosen.append(k)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [x for x in lines if "controllers" not in x]
    estimates = [x for x in lines if "controllers" in x]
    assert len(steps) == 299  # the first call has no step before it
    assert [s["k"] for s in steps] == chosen[:-1]
    assert all(s["batch"] == 2 for s in steps)
    drafted = [s for s in steps if s["k"]]
    assert drafted and all(s["drafts"] == 2 * s["k"] and s["accepted"] == s["k"]
                           for s in drafted)
    assert len(estimates) == 1
    greedy_est = estimates[0]["controllers"]["greedy"]
    assert greedy_est["accept"][0] > 0.4  # one of two requests accepted everything
    assert set(greedy_est["cost_ms"]["1"]) >= {"0", str(K)}  # bucket of batch 2
    assert (tmp_path / "steps.jsonl.rank1").exists() and rank1.step_log is not None


def test_step_log_path_is_checked(monkeypatch, tmp_path):
    from vllm_dflash2 import envs

    for bad in (str(tmp_path / "no-such-folder" / "steps.jsonl"), str(tmp_path)):
        monkeypatch.setenv("VLLM_DFLASH2_STEP_LOG", bad)
        with pytest.raises(ValueError, match="VLLM_DFLASH2_STEP_LOG=.*existing folder"):
            envs.get("VLLM_DFLASH2_STEP_LOG")
    monkeypatch.delenv("VLLM_DFLASH2_STEP_LOG")
    assert envs.get("VLLM_DFLASH2_STEP_LOG") is None


def test_a_larger_batch_starts_probing_late_where_no_k_pays_at_a_smaller_one():
    """Batch 8 measured one draft at 1.35 plain steps with acceptance 0.45 (no k pays
    there); batch 16's first probe then waits ``explore_max`` steps, not
    ``explore_every``: each probe there costs 2-3 plain steps."""
    ctl = AdaptiveSpeculation(K)
    chosen8 = _feed(ctl, 8, lambda k: 0.022 * (1 + 0.35 * k), accept_prob=0.45, steps=300)
    assert _mode(chosen8) == 0 and 1 in chosen8
    chosen16 = _feed(ctl, 16, lambda k: 0.028 * (1 + 0.8 * k), accept_prob=0.45, steps=200)
    first_probe = next(i for i, k in enumerate(chosen16) if k)
    assert first_probe >= ctl.explore_max, chosen16[:40]
    # Where batch 8 gains from drafting, batch 16 probes at the usual pace.
    ctl = AdaptiveSpeculation(K)
    assert _mode(_feed(ctl, 8, lambda k: 0.022 * (1 + 0.05 * k), accept_prob=0.8)) > 0
    chosen16 = _feed(ctl, 16, lambda k: 0.028 * (1 + 0.8 * k), accept_prob=0.45, steps=200)
    assert next(i for i, k in enumerate(chosen16) if k) < ctl.explore_max


def test_full_speculation_is_not_tried_where_its_cost_growth_rules_it_out():
    """Served, bf16, 2 cores: K = 7 cost 1.6 plain steps at batch 4, too little to rule it
    out at batch 16, where it then cost 4.9. Its cost at batches 2 and 4, extended as a
    line (step cost is convex in the batch), rules it out at 16 before it is tried."""
    plain = {2: 0.020, 4: 0.022, 16: 0.031}
    full = {2: 0.026, 4: 0.035}  # +4.5 ms a request: >= 0.089 s at batch 16 (2.9x plain)

    def run(batches):
        ctl = AdaptiveSpeculation(K)
        for n in batches:
            _feed(ctl, n, lambda k, n=n: plain[n] if k == 0 else full[n], accept_prob=0.5,
                  steps=40)
        return ctl

    ctl = run([2, 4])
    assert ctl.expected_tokens(K) > (1 + ctl.min_gain) * full[4] / plain[4]  # may pay at 4
    chosen = _feed(ctl, 16, lambda k: plain[16] * (1 + 0.8 * k), accept_prob=0.5, steps=30)
    assert K not in chosen, chosen
    # One bucket measured, no line: batch 16 tries K (the nearest ratio alone allows it).
    ctl = run([4])
    assert K in _feed(ctl, 16, lambda k: plain[16] * (1 + 0.8 * k), accept_prob=0.5,
                      steps=30)
    # Where the line leaves room (cheap rows), batch 16 still tries K.
    full = {2: 0.026, 4: 0.027}
    ctl = run([2, 4])
    assert K in _feed(ctl, 16, lambda k: plain[16] * (1 + 0.05 * k), accept_prob=0.5,
                      steps=30)


def test_drafting_costs_come_from_a_line_over_the_measured_ks_not_each_median():
    """Batch 1, high acceptance, drafts nearly free: full K pays most. K's two steps were
    measured while the machine was slow (1.4x); k = 1..4 since. Each k's own median
    kept K looking dear, and k climbed back to it one probe at a time; a line over every
    drafting k measured takes it at once."""
    truth = lambda k: 0.015 if k == 0 else 0.020 + 0.0002 * k  # noqa: E731
    ctl = AdaptiveSpeculation(K)
    ctl._full_tries[0] = ctl.full_k_tries  # the new-batch-size tries are the slow steps
    for k, n, slow in [(0, 3, 1.0), (K, 2, 1.4), (1, 3, 1.0), (2, 3, 1.0), (3, 3, 1.0),
                       (4, 3, 1.0)]:
        for _ in range(n):
            ctl.observe_step(1, k, slow * truth(k))
    assert ctl.estimated_cost(1, K) < 1.15 * truth(K)
    chosen = _feed(ctl, 1, truth, accept_prob=0.95, steps=60)
    assert chosen.count(K) >= 50, chosen
    # The fit never makes drafting cheaper than plain decoding, nor cheaper with k.
    ctl.samples[0][K].clear()
    ctl.observe_step(1, K, 0.012)
    assert all(ctl.estimated_cost(1, k) >= ctl.estimated_cost(1, 0) for k in range(K + 1))
    assert ctl.estimated_cost(1, K) >= ctl.estimated_cost(1, 1)


def test_step_log_takes_a_forced_k_controller(tmp_path):
    """Benchmarks force k (``profiling.force_k``) in engines that also write the step log;
    its 256th step wrote the controllers' estimates and crashed the engine on the stand-in."""
    import json

    from vllm_dflash2.adaptive import StepLog
    from vllm_dflash2.tools.bench.profiling import _FixedK

    path = tmp_path / "steps.jsonl"
    log, fixed = StepLog(path, every=2), _FixedK(0)
    for t in range(2):
        log.write({"t": t, "k": 0}, {True: fixed, False: fixed})
    log.file.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-1]["controllers"] == {"greedy": {"fixed_k": [0]}, "sampled": {"fixed_k": [0]}}
