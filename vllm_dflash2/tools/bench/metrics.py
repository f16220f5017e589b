"""An engine's Prometheus counters: its own, readable after other engines were built, and
vLLM's speculative-decoding counters between two reads (drafts, tau, acceptance per
position)."""

from __future__ import annotations


def keep_own_metrics(llm):
    """Call right after building ``llm``: its counters stay readable by ``metric_values``.

    vLLM registers one process-global set of Prometheus collectors per engine and
    unregisters the previous engine's, so ``get_metrics()`` of any LLM reports the
    counters of the most recently built one. Keep this engine's own collectors.
    """
    from prometheus_client import REGISTRY

    llm._dflash2_collectors = [
        c for c in list(REGISTRY._collector_to_names)
        if getattr(c, "_name", "").startswith("vllm:")
    ]
    return llm


def metric_values(llm, prefix: str = "vllm:") -> dict[str, float]:
    """This engine's Prometheus counters and gauges by name (labelled series summed).

    The same numbers as ``LLM.get_metrics()`` for the engine built last; for an engine
    made by ``tiny_llm`` (or marked by ``keep_own_metrics``) they stay its own after other
    engines were built.
    """
    collectors = getattr(llm, "_dflash2_collectors", None)
    out: dict[str, float] = {}
    if collectors is None:
        for m in llm.get_metrics():
            if m.name.startswith(prefix) and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0) + m.value
        return out
    for collector in collectors:
        for family in collector.collect():
            if not family.name.startswith(prefix) or family.type not in ("counter", "gauge"):
                continue
            for sample in family.samples:
                if family.type == "gauge" or sample.name.endswith("_total"):
                    out[family.name] = out.get(family.name, 0) + sample.value
    return out


def spec_decode_counts(llm) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far: tau = 1 + accepted / drafts between two reads."""
    m = metric_values(llm, "vllm:spec_decode")
    return (m.get("vllm:spec_decode_num_drafts", 0.0),
            m.get("vllm:spec_decode_num_accepted_tokens", 0.0))


def spec_decode_metrics(llm) -> dict:
    """Every ``vllm:spec_decode*`` metric of ``LLM.get_metrics()`` by name: a number, or
    a list for the per-position counters. For the engine built last (several engines
    alive at once: ``spec_decode_counts`` on engines marked by ``keep_own_metrics``)."""
    vals: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):
            vals[m.name] = list(m.values)
        elif hasattr(m, "value"):
            vals[m.name] = m.value
    return vals


def metrics_delta(before: dict, after: dict) -> dict:
    """``after - before`` per name, element-wise for lists; a name new in ``after`` counts
    from zero."""
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old)]
        else:
            out[name] = value - (old or 0)
    return out


def acceptance_summary(delta: dict) -> dict:
    """Drafts, draft and accepted tokens, tau (mean acceptance length, the bonus token
    included) and acceptance per draft position, from a ``metrics_delta`` of
    ``spec_decode_metrics`` (tau None and no positions where nothing was drafted)."""
    drafts = delta.get("vllm:spec_decode_num_drafts", 0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = delta.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    return {
        "num_drafts": drafts,
        "num_draft_tokens": delta.get("vllm:spec_decode_num_draft_tokens", 0),
        "num_accepted_tokens": accepted,
        "tau": 1.0 + accepted / drafts if drafts else None,
        "acceptance_per_pos": [x / drafts for x in per_pos] if drafts else [],
    }
