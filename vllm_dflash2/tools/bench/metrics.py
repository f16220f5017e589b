"""An engine's own Prometheus counters, readable after other engines were built."""

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
