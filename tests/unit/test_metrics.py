"""The one reader of vLLM's speculative-decoding counters (tools/bench/metrics.py), as
the demo and `vllm-dflash2 eval` use it: two reads, their difference, the summary."""

from types import SimpleNamespace

from vllm_dflash2.tools.bench.metrics import (
    acceptance_summary,
    metrics_delta,
    spec_decode_metrics,
)


def _llm(drafts, draft_tokens, accepted, per_pos):
    counter = lambda name, v: SimpleNamespace(name=name, value=v)  # noqa: E731
    metrics = [
        counter("vllm:spec_decode_num_drafts", drafts),
        counter("vllm:spec_decode_num_draft_tokens", draft_tokens),
        counter("vllm:spec_decode_num_accepted_tokens", accepted),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
        counter("vllm:prompt_tokens", 999),  # not a spec-decode counter
        SimpleNamespace(name="vllm:spec_decode_histogram_like"),  # neither value nor values
    ]
    return SimpleNamespace(get_metrics=lambda: metrics)


def test_two_reads_give_tau_and_acceptance_per_position():
    before = spec_decode_metrics(_llm(10, 70, 12, [8, 3, 1]))
    assert before == {
        "vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 70,
        "vllm:spec_decode_num_accepted_tokens": 12,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [8, 3, 1],
    }
    after = spec_decode_metrics(_llm(30, 210, 42, [24, 13, 5]))
    delta = metrics_delta(before, after)
    assert delta["vllm:spec_decode_num_drafts"] == 20
    assert delta["vllm:spec_decode_num_accepted_tokens_per_pos"] == [16, 10, 4]
    summary = acceptance_summary(delta)
    assert summary == {"num_drafts": 20, "num_draft_tokens": 140, "num_accepted_tokens": 30,
                       "tau": 2.5, "acceptance_per_pos": [0.8, 0.5, 0.2]}


def test_first_read_and_no_drafts():
    after = spec_decode_metrics(_llm(4, 28, 2, [2]))
    assert metrics_delta({}, after) == after  # names new in ``after`` count from zero
    nothing = acceptance_summary(metrics_delta(after, after))
    assert nothing["tau"] is None and nothing["acceptance_per_pos"] == []
    assert acceptance_summary({})["num_drafts"] == 0  # an engine without a drafter
