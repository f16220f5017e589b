"""Where a speculative step spends its time, measured inside a running vLLM worker.

``install`` wraps (on instances only, for the life of that engine) the runner and
drafter methods that make up one step, with wall-clock timers. It is a measuring
instrument for ``benchmarks/profile_step.py``, not a behaviour change, and is never
installed by the plugin itself. On the CPU backend every op is synchronous, so
wall-clock spans are exact; on CUDA each span synchronizes first.

Call through ``LLM.collective_rpc`` (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``):
``llm.collective_rpc(install)``, ``reset``, ``read``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

_TIMES: dict[str, float] = defaultdict(float)
_COUNTS: dict[str, int] = defaultdict(int)
_NESTED: dict[str, float] = defaultdict(float)  # timed calls made inside a key's calls
_ACTIVE: list[str] = []  # keys of the timed calls now running, outermost first
_INSTALLED_ATTR = "_vllm_dflash2_profiled"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _wrap(obj, attr: str, key: str) -> None:
    orig = getattr(obj, attr, None)
    if orig is None or getattr(orig, _INSTALLED_ATTR, False):
        return

    def timed(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        _ACTIVE.append(key)
        try:
            return orig(*args, **kwargs)
        finally:
            _sync()
            spent = time.perf_counter() - start
            _ACTIVE.pop()
            _TIMES[key] += spent
            _COUNTS[key] += 1
            if _ACTIVE:
                _NESTED[_ACTIVE[-1]] += spent

    setattr(timed, _INSTALLED_ATTR, True)
    setattr(obj, attr, timed)


def install(worker) -> list[str]:
    runner = worker.model_runner
    _wrap(runner, "execute_model", "step/execute_model")
    _wrap(runner, "sample_tokens", "step/sample_tokens")
    _wrap(runner, "_model_forward", "target/forward")
    _wrap(runner.model, "compute_logits", "target/logits")
    _wrap(runner, "_sample", "sample/sample_or_reject")
    target_layers = getattr(getattr(runner.model, "model", None), "layers", [])
    for layer in target_layers:  # summed over layers: where a target step goes
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            _wrap(attn, "forward", "target/layers/attention_block")
            if hasattr(attn, "attn"):
                _wrap(attn.attn, "forward", "target/layers/attention_kernel")
        if hasattr(layer, "mlp"):
            _wrap(layer.mlp, "forward", "target/layers/mlp")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        _wrap(runner, "propose_draft_token_ids", "draft/total")
        _wrap(drafter, "set_inputs_first_pass", "draft/input_prep")
        # Upstream's runner -> drafter input steps, run on every step once speculation
        # is configured.
        _wrap(drafter, "prepare_next_token_ids_padded", "draft/vllm_prepare_padded")
        _wrap(drafter, "prepare_inputs_padded", "draft/vllm_prepare_padded")
        # Ours at k = 0: stashing a step's context rows, settling departed requests' rows
        # (their draft K/V writes nest in it and are timed as context rows below).
        deferred = getattr(drafter, "deferred", None)
        if deferred is not None:
            _wrap(deferred, "stash", "draft/context_stash")
            _wrap(deferred, "settle_departed", "draft/context_stash")
        _wrap(drafter, "build_per_group_and_layer_attn_metadata", "draft/attn_metadata")
        model = drafter.model
        _wrap(model, "combine_hidden_states", "draft/context_kv")  # the fc over context rows
        _wrap(model, "precompute_and_store_context_kv", "draft/context_kv")
        _wrap(model, "forward", "draft/forward")
        _wrap(drafter, "_sample_draft_tokens", "draft/candidates_and_selector")
        for i, layer in enumerate(getattr(model.model, "layers", [])):
            for name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, name, None)
                if conv is not None:
                    _wrap(conv, "prepare", f"draft/layer{i}/conv")
                    _wrap(conv, "finish", f"draft/layer{i}/conv")
            if hasattr(layer, "self_attn"):
                _wrap(layer.self_attn, "forward", f"draft/layer{i}/attention")
            if hasattr(layer, "mlp"):
                _wrap(layer.mlp, "forward", f"draft/layer{i}/mlp")
    return sorted(_COUNTS)


def reset(worker) -> None:
    _TIMES.clear()
    _COUNTS.clear()
    _NESTED.clear()


def read(worker) -> dict[str, dict[str, float]]:
    """key -> seconds (inclusive), calls, and nested_seconds: the part of those seconds
    spent in other timed calls made from inside it."""
    return {k: {"seconds": _TIMES[k], "calls": _COUNTS[k], "nested_seconds": _NESTED[k]}
            for k in sorted(_TIMES)}


def adaptive_state(worker) -> dict | None:
    """The adaptive-speculation controller's estimates (None when it is off)."""
    adaptive = getattr(worker.model_runner.drafter, "adaptive", None)
    if adaptive is None:
        return None
    greedy = adaptive.controllers[True].snapshot()
    sampled = adaptive.controllers[False].snapshot()
    # Merged view (tests read cost_ms keys); each controller also returned on its own.
    cost = {}
    for snap in (greedy, sampled):
        for b, costs in snap["cost_ms"].items():
            cost.setdefault(b, {}).update(costs)
    return {"cost_ms": cost, "greedy": greedy, "sampled": sampled}


def step_record(worker, clear: bool = True) -> list[dict] | None:
    """The adaptive steps the proposer recorded (``VLLM_DFLASH2_STEP_RECORD=N`` keeps the
    last N; None when off), oldest first: step wall time, batch size, k drafted, the
    longest query (a prefill chunk makes it exceed k + 1, and the step unmeasured),
    drafts and accepted tokens, context rows held for deferred writes. ``clear`` empties it."""
    adaptive = getattr(getattr(worker.model_runner, "drafter", None), "adaptive", None)
    record = getattr(adaptive, "step_record", None)
    if record is None:
        return None
    out = list(record)
    if clear:
        record.clear()
    return out


class _FixedK:
    """A stand-in controller that drafts ``k`` every step (0: plain decoding, draft KV
    kept), or, given a list, its entries in turn, one per step."""

    def __init__(self, k: int | list[int]) -> None:
        self.ks = [k] if isinstance(k, int) else list(k)
        self.step = 0

    def choose(self, batch_size: int, k_limit: int | None = None) -> int:
        k = self.ks[self.step % len(self.ks)]
        self.step += 1
        return k if k_limit is None else min(k, k_limit)

    def observe_acceptance(self, k_used: int, accepted: list[int],
                           batch_size: int | None = None) -> None:
        pass

    def observe_step(self, batch_size: int, k_used: int, seconds: float) -> None:
        pass

    def snapshot(self) -> dict:
        """What ``VLLM_DFLASH2_STEP_LOG`` writes every 256 steps in place of estimates."""
        return {"fixed_k": list(self.ks)}


def force_k(worker, k: int | list[int]) -> None:
    """Make an adaptive drafter draft exactly ``k`` every step (measures what k = 0,
    adaptive's plain decoding inside a speculative engine, costs over a plain engine),
    or the ks of a list in turn (one sequence shared by greedy and sampled steps)."""
    adaptive = worker.model_runner.drafter.adaptive
    if adaptive is None:
        raise RuntimeError("force_k needs adaptive speculation on (VLLM_DFLASH2_ADAPTIVE=1)")
    fixed = _FixedK(k)
    adaptive.controllers = {greedy: fixed for greedy in (True, False)}
    adaptive.controller = fixed


def install_clock(worker, clock) -> int:
    """Give the adaptive controller ``clock`` (a ``load.ExcludingClock``) in place of
    ``time.perf_counter``. Returns the id of the clock the proposer now holds: equal to
    ``id(clock)`` only where the worker runs in the caller's process, which lockstep
    needs (the caller tells the clock what to leave out)."""
    adaptive = worker.model_runner.drafter.adaptive
    adaptive.clock = clock
    return id(adaptive.clock)


def context_counters(worker) -> dict[str, int]:
    """How many context rows the proposer deferred, how many batched writes it made and
    how many rows they wrote, how many rows of departed requests it dropped (partial
    blocks) and how many rows are not settled yet (see deferred_context.py); all 0 where
    context is not deferred."""
    deferred = worker.model_runner.drafter.deferred
    if deferred is None:
        return {"deferred_rows": 0, "writes": 0, "written_rows": 0, "dropped_rows": 0,
                "unwritten_rows": 0}
    return {"deferred_rows": deferred.rows_deferred, "writes": deferred.flushes,
            "written_rows": deferred.rows_written, "dropped_rows": deferred.rows_dropped,
            "unwritten_rows": deferred.unwritten_rows()}
