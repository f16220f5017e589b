"""Adaptive speculation: pick how many tokens to draft from measured speed.

A draft+verify step with k drafts costs T(b, k) at batch size b and yields
E(k) = 1 + sum_{i<=k} P(first i drafts accepted) tokens per request. The
controller measures both while serving (step wall time between two proposals,
acceptance from the rejection sampler's counts) and drafts the k that maximizes
E(k) / T(b, k); k = 0 is plain decoding, so where speculation does not pay at the
current batch size it is switched off. It tries a neighbour of its choice now and then
(from plain decoding: the drafting k it rates best, where one may pay) so that stale
estimates get refreshed: ``explore_every`` steps after the choice at a batch size last
changed, then at doubling gaps up to ``explore_max`` steps while the choice holds, and up
to ``hopeless_gap_factor`` times that where even full acceptance could not pay
(``_hopeless``; there the first gap is ``explore_max``, as at a new batch size where a
smaller one shows that no k pays: ``_none_pays_below``).
The gaps grow because a probe at a large batch size costs up to twice a step
(verification is compute-bound there): probing at a fixed rate is a fixed loss.

Plain decoding is the baseline every choice is measured against, so its cost is
never trusted on one step: a new batch size measures ``baseline_samples`` plain
steps before deciding, and once speculating, the first probe and every fourth after
it re-measure the baseline from scratch (that many plain steps): one stalled plain
step taken as the baseline makes drafting look worth it where its acceptance never pays.
A new batch size measures plain decoding first, then tries two steps of full K (the first
pays one-off set-up, see below), unless smaller batch sizes already show that full K
cannot pay (``_cannot_pay_below``), and only that once: a step that also carries a
prefill chunk is not measured, and the batch sizes a burst of arrivals passes through may
only ever come with one, so a full-K try there (about twice a plain step beside the
prefill) would come back with every burst; plain decoding first keeps those batch sizes
from trying it at all. Then k climbs from the probes, at most one past the largest k
measured at that batch size, since a line through two noisy points can make every k look
free. What these rules were measured against: ``docs/performance.md``, "Measurements
behind the code".

Step times on a shared CPU are noisy (a 2-3x spike is common), so a cost is the
median of the last ``window`` measurements of that (batch bucket, k), and k > 0
must be estimated ``min_gain`` faster than plain decoding to be chosen: a marginal
estimated gain is within the noise, and losing to plain decoding is the failure
this controller exists to prevent. The first step of a (batch bucket, k) often pays
one-off set-up for the new GEMM shapes (served, batch 1, bf16: 200 ms for the first
K = 7 step against ~35 ms after it); a median of one sample would keep that until the
pair is measured twice more, which a choice it rules out may never be, so a second
measurement ``cold_factor`` times cheaper replaces the first.

Pure Python on purpose: it runs once per step on the host and is unit-tested
without an engine. ``AdaptiveDrafting`` (below) wires it into ``DFlash2Proposer``
(``VLLM_DFLASH2_ADAPTIVE``; default on for the CPU backend, where it is measured, off
on GPUs: reading the accepted counts each step would add a device sync there).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from . import envs

ENV = "VLLM_DFLASH2_ADAPTIVE"


def enabled_from_env(default: bool = True) -> bool:
    return envs.get(ENV, default)


def bucket(batch_size: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share estimates (cost grows ~ with log b here)."""
    return max(0, math.ceil(math.log2(max(1, batch_size))))


# Probes cycle through these directions; the baseline one re-measures plain decoding.
_PROBE_CYCLE = ("up", "down", "up", "baseline")
_BASELINE_PHASE = _PROBE_CYCLE.index("baseline")


@dataclass
class _Probes:
    """When a batch-size bucket next tries a neighbour of its current choice."""

    choice: int
    gap: int
    next_step: int
    count: int = 0  # probes so far; probe i goes _PROBE_CYCLE[i % len(_PROBE_CYCLE)]


def _rising_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of a Theil-Sen line through (x, y) points, its slope at least 0:
    the median of the pairwise slopes, then the median of the intercepts. One stale point
    among three or more does not tilt it, as it would a least-squares line (most of all
    at the largest x)."""
    slope = max(0.0, median((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
                            for x2, y2 in points[i + 1:]))
    return median(y - slope * x for x, y in points), slope


class AdaptiveSpeculation:
    def __init__(self, max_k: int, explore_every: int = 16, explore_max: int = 128,
                 window: int = 9, baseline_samples: int = 3,
                 accept_decay: float = 0.99, prior_accept: float = 0.7,
                 idle_factor: float = 4.0, min_gain: float = 0.1,
                 hopeless_gap_factor: int = 8, cold_factor: float = 1.5,
                 full_k_tries: int = 2):
        if max_k < 1:
            raise ValueError(f"max_k={max_k}: expected >= 1")
        self.max_k = max_k
        self.explore_every = explore_every
        self.explore_max = max(explore_every, explore_max)
        self.window = window
        self.baseline_samples = max(1, min(baseline_samples, window))
        self.accept_decay = accept_decay
        self.idle_factor = idle_factor
        self.min_gain = min_gain
        self.hopeless_gap_factor = max(1, hopeless_gap_factor)
        self.cold_factor = cold_factor
        self.full_k_tries = max(1, full_k_tries)
        # P(draft i accepted | drafts before it accepted), i = 1..max_k, as decayed
        # hit/trial counts (a memory of ~1/(1-decay) steps) plus one pseudo-trial of an
        # optimistic prior, so that a position is tried before it is written off and one
        # unlucky step cannot. Conditional, so that a step whose first draft was
        # rejected says nothing about the later ones: counted as misses at every
        # position, a few steps without acceptance wrote the last positions off long
        # after acceptance came back (they are refreshed only by steps that draft K).
        self.prior = [prior_accept] * max_k
        self.hits = [0.0] * max_k  # requests that accepted draft i
        self.trials = [0.0] * max_k  # requests that reached draft i (all before accepted)
        self.samples: dict[int, dict[int, deque]] = {}  # bucket -> k -> recent seconds per step
        self.steps: dict[int, int] = {}
        self._full_tries: dict[int, int] = {}  # bucket -> full-K steps tried at a new bucket
        self._probes: dict[int, _Probes] = {}
        # All-time per (bucket, k): step count, seconds and summed batch sizes (reports, the
        # new-bucket full-K tries and ``_cannot_pay_below``'s mean batch sizes). For reports
        # only: chosen k, and drafted / accepted tokens per bucket.
        self.chosen: dict[int, dict[int, int]] = {}
        self.totals: dict[int, dict[int, list]] = {}
        self.accepted_by_bucket: dict[int, list[int]] = {}

    @property
    def accept(self) -> list[float]:
        """P(first i drafts accepted), i = 1..max_k."""
        out, last = [], 1.0
        for p, h, n in zip(self.prior, self.hits, self.trials):
            last *= (h + p) / (n + 1.0)
            out.append(last)
        return out

    # -- measurements ------------------------------------------------------------
    def observe_acceptance(self, k_used: int, accepted: list[int],
                           batch_size: int | None = None) -> None:
        """accepted[r]: drafts of request r accepted in a step that drafted k_used."""
        if k_used <= 0 or not accepted:
            return
        if batch_size is not None:  # per bucket, for reports: drafts and accepted tokens
            seen = self.accepted_by_bucket.setdefault(bucket(batch_size), [0, 0])
            seen[0] += k_used * len(accepted)
            seen[1] += sum(accepted)
        for j in range(min(k_used, self.max_k)):
            self.hits[j] = self.accept_decay * self.hits[j] + sum(1 for a in accepted if a > j)
            self.trials[j] = (self.accept_decay * self.trials[j]
                              + sum(1 for a in accepted if a >= j))

    def observe_step(self, batch_size: int, k_used: int, seconds: float) -> None:
        b = bucket(batch_size)
        recent = self.samples.setdefault(b, {}).setdefault(k_used, deque(maxlen=self.window))
        if recent and seconds > self.idle_factor * median(recent):
            return  # the engine sat idle between two steps: not a step cost
        total = self.totals.setdefault(b, {}).setdefault(k_used, [0, 0.0, 0])
        if total[0] == 1 and len(recent) == 1 and recent[0] > self.cold_factor * seconds:
            recent.clear()  # the pair's first step paid one-off set-up (module docstring)
        recent.append(seconds)
        total[0] += 1
        total[1] += seconds
        total[2] += batch_size

    def _costs(self, b: int) -> dict[int, float]:
        """k -> seconds per step in bucket ``b`` (median of the recent measurements)."""
        return {k: median(v) for k, v in self.samples.get(b, {}).items() if v}

    @property
    def cost(self) -> dict[int, dict[int, float]]:
        """bucket -> k -> seconds per step (median of the recent measurements)."""
        return {b: self._costs(b) for b in self.samples}

    # -- decision ----------------------------------------------------------------
    def expected_tokens(self, k: int, accept: list[float] | None = None) -> float:
        return 1.0 + sum((self.accept if accept is None else accept)[:k])

    def estimated_cost(self, batch_size: int, k: int) -> float | None:
        """Seconds per step of k drafts at this batch size (``_cost_model``)."""
        return self._cost_model(self._costs(bucket(batch_size)))(k)

    @staticmethod
    def _cost_model(costs: dict[int, float]) -> Callable[[int], float | None]:
        """k -> seconds per step, from one bucket's ``_costs``; fitted once, asked per k.

        Plain decoding: its median. Drafting, once two drafting ks are measured: a robust
        line over their medians, not each k's own median. Each k is measured at other
        moments of a drifting machine, and the medians of the ks not chosen lately go
        stale: lockstep, batch 1, bf16, k = 1..4 read 23.1, 19.6, 18.6 and 23.3 ms, and
        k = 3 held for ~170 steps where K = 7 paid more. A line with a negative slope is
        flat (drafts cannot get cheaper with k), and no drafting step is cheaper than a
        plain one. Otherwise a measured k's median, and for the others the least-squares
        line through every measured (k, cost) point (None with fewer than two)."""
        drafting = [(j, t) for j, t in costs.items() if j > 0]
        rising = _rising_line(drafting) if len(drafting) >= 2 else None
        floor = costs.get(0, 0.0)
        line = None
        if len(costs) >= 2:
            ks, ts = zip(*sorted(costs.items()))
            mk, mt = sum(ks) / len(ks), sum(ts) / len(ts)
            var = sum((x - mk) ** 2 for x in ks)
            slope = sum((x - mk) * (t - mt) for x, t in zip(ks, ts)) / var if var else 0.0
            line = (mk, mt, slope)

        def cost(k: int) -> float | None:
            if k > 0 and rising is not None:
                return max(floor, rising[0] + rising[1] * k, 1e-9)
            if k in costs:
                return costs[k]
            if line is None:
                return None
            return max(1e-9, line[1] + line[2] * (k - line[0]))

        return cost

    def _cannot_pay_below(self, b: int, k: int, batch_size: int | None = None) -> bool:
        """Whether smaller buckets show that k cannot pay at bucket ``b`` either, by
        either of two lower bounds on its cost ratio to plain decoding here.
        Verification only gets more compute-bound with the batch, so the nearest smaller
        bucket's ratio (with k and plain decoding measured) is one: at batch 16 here one
        K = 7 step cost 6.7 plain steps, too much to spend on finding that out. The other
        holds where that ratio is still low (served, bf16: K = 7 at 1.6 plain steps at
        batch 4, then 2.9 at 5-8 and 4.9 at 9-16): step cost is convex in the batch (a
        flat, memory-bound stretch, then compute-bound), so the line through k's costs
        at the two nearest smaller buckets, at their mean batch sizes, extended to
        ``batch_size`` stays below k's cost there; over this bucket's plain cost."""
        nearest = [(x, costs) for x in sorted(self.samples, reverse=True) if x < b
                   for costs in [self._costs(x)] if k in costs]
        for _, costs in nearest:
            if 0 in costs:
                if self._loses(k, costs[k], costs[0]):
                    return True
                break
        plain = self._costs(b).get(0)
        if batch_size is None or plain is None or len(nearest) < 2:
            return False
        (n2, t2), (n1, t1) = ((self.totals[x][k][2] / self.totals[x][k][0], costs[k])
                              for x, costs in nearest[:2])
        if n2 <= n1 or t2 <= t1:
            return False
        return self._loses(k, t2 + (t2 - t1) * (batch_size - n2) / (n2 - n1), plain)

    def _none_pays_below(self, b: int) -> bool:
        """Whether the nearest smaller bucket with plain decoding and some drafting k
        measured shows that no measured k pays there, at the acceptance measured now (a
        lower bound on the cost ratios here, as in ``_cannot_pay_below``). Lockstep,
        batch 16 (bf16, 120 steps): each of the first probes, 16 and 32 steps apart,
        cost 2-3 plain steps (one draft beside the deferred context written at once),
        ~4% of the run, where batch 8 had already shown that one draft does not pay."""
        for smaller in sorted((x for x in self.samples if x < b), reverse=True):
            costs = self._costs(smaller)
            drafting = [k for k in costs if k > 0]
            if 0 in costs and drafting:
                return all(self._loses(k, costs[k], costs[0]) for k in drafting)
        return False

    def _loses(self, k: int, cost: float, plain: float) -> bool:
        """Whether k drafts at ``cost`` a step, at the acceptance measured now, gain less
        than ``min_gain`` over plain decoding at ``plain`` a step."""
        return self.expected_tokens(k) < (1 + self.min_gain) * cost / plain

    def _hopeless(self, b: int, top: int, min_probes: int = 2) -> bool:
        """Whether drafting cannot pay at bucket ``b`` even if every draft were accepted:
        (1 + k) tokens for a step whose cost grows like plain * (1 + a k), where a is the
        measured extra cost of one draft (at least ``min_probes`` k = 1 steps and the
        baseline, here or at a smaller bucket: verification only gets more compute-bound
        with the batch). Such a bucket still probes, at long gaps: there a k = 1 probe
        costs about two plain steps."""
        for smaller in sorted((x for x in self.samples if x <= b), reverse=True):
            measured = self.samples[smaller]
            if (len(measured.get(1, ())) < min_probes
                    or len(measured.get(0, ())) < self.baseline_samples):
                continue
            costs = self._costs(smaller)
            a = costs[1] / costs[0] - 1
            best = max((1 + k) / (1 + a * k) for k in {1, top})  # (1+k)/(1+ak) is monotonic
            return best < 1 + self.min_gain
        return False

    def choose(self, batch_size: int, k_limit: int | None = None) -> int:
        k = self._choose(batch_size, k_limit)
        counts = self.chosen.setdefault(bucket(batch_size), {})
        counts[k] = counts.get(k, 0) + 1
        return k

    def _choose(self, batch_size: int, k_limit: int | None) -> int:
        top = self.max_k if k_limit is None else max(0, min(self.max_k, k_limit))
        if top == 0:
            return 0
        b = bucket(batch_size)
        measured = self.samples.get(b, {})
        # A new batch size: measure plain decoding a few times (also after a baseline
        # probe cleared it), then full speculation (twice: the first step may pay set-up;
        # unless smaller batch sizes already show it cannot pay).
        if len(measured.get(0, ())) < self.baseline_samples:
            return 0
        tries = self._full_tries.get(b, 0)
        if (tries < self.full_k_tries and self.totals.get(b, {}).get(top, (0,))[0] < 2
                and (tries or not self._cannot_pay_below(b, top, batch_size))):
            self._full_tries[b] = tries + 1
            return top
        # Once per step: the medians and the acceptance curve, then E(k) / T(b, k) for every k.
        costs, accept = self._costs(b), self.accept
        # k climbs at most one past the largest k measured here: a line through noisy
        # points (one cheap probe of k = 1) can make every k look free.
        reach = min(top, max(costs) + 1)
        rates, cost_of = [], self._cost_model(costs)
        for k in range(reach + 1):
            cost = cost_of(k)
            rates.append(0.0 if cost is None else self.expected_tokens(k, accept) / cost)
        best = max(range(reach + 1), key=rates.__getitem__)
        if best and rates[best] < (1 + self.min_gain) * rates[0]:
            best = 0  # a gain within the noise is not worth the risk of a loss
        step = self.steps[b] = self.steps.get(b, 0) + 1
        if not self.explore_every:
            return best
        probes = self._probes.get(b)
        if probes is None or probes.choice != best:  # a new choice: probe soon again
            count = 0 if probes is None else probes.count
            if best > 0 and (probes is None or probes.choice == 0):
                count = _BASELINE_PHASE  # speculation just started: first re-check the baseline
            # ...unless plain decoding was chosen where drafting cannot pay: there a probe
            # (and the flush of the deferred context before it) costs about two plain
            # steps, and the early, short gaps would tax every run for nothing. That
            # verdict then rests on 4 probes: the median of 2 is their mean, and one
            # stalled probe would silence a batch size where drafting pays. Nor where a
            # smaller batch size shows no k pays at the acceptance measured now.
            slow = best == 0 and (self._hopeless(b, top, min_probes=4)
                                  or (probes is None and self._none_pays_below(b)))
            gap = self.explore_max if slow else self.explore_every
            probes = self._probes[b] = _Probes(best, gap, step + gap, count)
        if step < probes.next_step:
            return best
        longest = self.explore_max * (self.hopeless_gap_factor
                                      if best == 0 and self._hopeless(b, top) else 1)
        probes.gap = min(2 * probes.gap, longest)
        probes.next_step = step + probes.gap
        direction = _PROBE_CYCLE[probes.count % len(_PROBE_CYCLE)]
        probes.count += 1
        if best > 0 and direction == "baseline":
            measured[0].clear()  # re-measured from scratch by the next plain steps
            return 0
        if best == 0:
            # From plain decoding, probe the best drafting k where one looks like it may
            # pay (with a large fixed cost of drafting, served at batch 1: k = 1 cost 1.5
            # plain steps and K = 7 1.6, a probe of one draft only ever says "no", and
            # refreshes one position's acceptance); where none does, the cheapest probe.
            # reach >= 1 here: plain decoding's cost is measured.
            best_drafting = max(range(1, reach + 1), key=rates.__getitem__)
            return best_drafting if rates[best_drafting] > rates[0] else 1
        return best + 1 if direction == "up" and best < top else best - 1

    def snapshot(self) -> dict:
        return {"accept": list(self.accept),
                "cost_ms": {b: {k: v * 1e3 for k, v in sorted(c.items())}
                            for b, c in sorted(self.cost.items())},
                "chosen": {b: dict(sorted(c.items())) for b, c in sorted(self.chosen.items())},
                "mean_ms": {b: {k: t / n * 1e3 for k, (n, t, _) in sorted(c.items())}
                            for b, c in sorted(self.totals.items())},
                "drafted_accepted": dict(sorted(self.accepted_by_bucket.items()))}


class AdaptiveDrafting:
    """The proposer's side of adaptive speculation: feeds each step's measurements to a
    controller and asks it for the next k.

    One controller for all-greedy batches, one for batches that sample: acceptance and
    step cost (dense q, probabilistic rejection) differ between the two. A step's cost is
    the wall time between two proposals on ``clock``; a benchmark that steps several
    engines of one process in turn swaps in one that leaves out the other engines' steps
    (``tools.bench.load.ExcludingClock``). ``step_record`` keeps what the controller saw
    (``VLLM_DFLASH2_STEP_RECORD``), for benchmarks; ``step_log`` writes it to a file
    (``VLLM_DFLASH2_STEP_LOG``), for users.

    ``agree`` makes the k of every tensor-parallel rank the same: each rank times its own
    steps, so their controllers can choose differently, and ranks that draft different k
    run collectives of different shapes. The proposer passes a broadcast of rank 0's k."""

    def __init__(self, max_k: int, agree: Callable[[int], int] | None = None,
                 rank: int = 0):
        self.controllers = {greedy: AdaptiveSpeculation(max_k) for greedy in (True, False)}
        self.controller = self.controllers[True]  # the one that chose the step in flight
        self.clock = time.perf_counter
        self.agree = agree
        keep = envs.get("VLLM_DFLASH2_STEP_RECORD")
        self.step_record: deque | None = deque(maxlen=keep) if keep else None
        path = envs.get("VLLM_DFLASH2_STEP_LOG")
        self.step_log = None if path is None else StepLog(
            path if rank == 0 else path.with_name(f"{path.name}.rank{rank}"))
        self._k_prev = 0
        self._t_prev: float | None = None
        self._verified: tuple[list[int], object] | None = None
        # Rows (seeded requests) that draft K while the rest of the step drafts the chosen k;
        # non-empty means the step in flight is mixed (read by the next ``_observe``).
        self.pinned_rows: list[int] = []

    def note_verified(self, num_draft_tokens: list[int], valid_counts) -> None:
        """The runner's verification of the previous step: drafts per request and the
        valid sampled tokens per request (a tensor; read at the next ``choose``)."""
        self._verified = (num_draft_tokens, valid_counts)

    def skip_measurement(self) -> None:
        """The proposal just chosen was dropped (the proposer's non-finite guard): the next
        step verifies fewer drafts than chosen, so neither its cost nor its acceptance is
        measured against that k."""
        self._k_prev, self._t_prev = 0, None

    def choose(self, cad, sampling_metadata, max_k: int, write_seconds: float = 0.0,
               pending_rows: int = 0) -> int:
        """k for this step, after observing the step just verified. ``write_seconds``:
        deferred context writes since the last call; ``pending_rows``: rows still stashed."""
        now = self.clock()
        self._observe(now, cad, write_seconds, pending_rows)  # the previous controller
        self.controller = self.controllers[bool(sampling_metadata.all_greedy)]
        k = self.controller.choose(cad.batch_size(), max_k)
        if self.agree is not None:
            k = self.agree(k)
        # A seeded request's samples depend on how many drafts each step verified, and a
        # timing-driven k would make its reruns differ: seeded rows always draft K. The
        # others keep k, so one seeded client does not pin the whole batch to K.
        seeded = sorted(sampling_metadata.generators or ())
        if k < max_k and seeded and len(seeded) >= cad.batch_size():
            k = max_k  # every row is seeded: a uniform step of K
        self.pinned_rows = seeded if k < max_k else []
        self._k_prev, self._t_prev = k, now
        return k

    def unpin(self, max_k: int) -> int:
        """The runner cannot take per-row draft counts (asynchronous scheduling reads one
        [batch, k] tensor): the step chosen with pinned rows drafts K for every row."""
        if self.pinned_rows:
            self.pinned_rows, self._k_prev = [], max_k
        return self._k_prev

    def _observe(self, now: float, cad, written: float, pending_rows: int) -> None:
        k_prev, t_prev, verified = self._k_prev, self._t_prev, self._verified
        self._verified = None
        mixed = bool(self.pinned_rows)  # the step just verified, as chosen
        accepted: list[int] = []  # per verified request with drafts
        drafted = 0
        if verified is not None:
            num_drafts, valid = verified
            rows = [(n, v - 1) for n, v in zip(num_drafts, valid.tolist()) if n > 0 and v > 0]
            by_k: dict[int, list[int]] = {}
            for n, a in rows:  # seeded rows drafted K beside the others' k
                by_k.setdefault(n, []).append(a)
            for n, acc in by_k.items():
                self.controller.observe_acceptance(n, acc, len(num_drafts))
            accepted = [a for _, a in rows]
            drafted = sum(n for n, _ in rows)
        # Steps that carried a prefill chunk cost more than a decode step, and a step whose
        # seeded rows drafted K beside the others' k costs neither: skip them.
        measured = t_prev is not None and not mixed and cad.max_query_len <= k_prev + 1
        # Deferred context writes are left out of the step that flushes them, mostly a
        # probe after a run of k = 0 steps: steady drafting flushes nothing, and a probe
        # carrying the flush (served, batch 1: +10%, ~1.5x a plain step in all) made
        # drafting look dearer than it is, so adaptive stayed plain where K = 7 paid
        # 1.3x. Probes stay rare where drafting cannot pay: their gaps back off, longest
        # where even full acceptance could not (``AdaptiveSpeculation._hopeless``).
        # The record keeps the split.
        if measured:
            self.controller.observe_step(cad.batch_size(), k_prev,
                                         max(1e-6, now - t_prev - written))
        if t_prev is not None and (self.step_record is not None
                                   or self.step_log is not None):
            step = {
                "t": now, "seconds": now - t_prev, "context_write_s": written,
                "batch": cad.batch_size(), "k": k_prev,
                "max_query_len": cad.max_query_len, "measured": measured,
                "greedy": self.controller is self.controllers[True],
                "drafts": drafted, "accepted": sum(accepted), "mixed": mixed,
                "pending_rows": pending_rows}
            if self.step_record is not None:
                self.step_record.append(step)
            if self.step_log is not None:
                self.step_log.write(step, self.controllers)


class StepLog:
    """``VLLM_DFLASH2_STEP_LOG``: one JSON line per step, and every ``every`` steps one
    line with both controllers' estimates. Written as it goes (line-buffered), so a
    server that is killed leaves a readable file; one ``json.dumps`` per step."""

    def __init__(self, path, every: int = 256):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (kept open while serving)
        self.every = every
        self.steps = 0

    def write(self, step: dict, controllers: dict) -> None:
        self.file.write(json.dumps(step) + "\n")
        self.steps += 1
        if self.steps % self.every == 0:
            self.file.write(json.dumps({"t": step["t"], "controllers": {
                "greedy" if greedy else "sampled": c.snapshot()
                for greedy, c in controllers.items()}}) + "\n")
