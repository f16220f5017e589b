"""Tiny drafters in every published DFlash2 layout (``tiny_models.LAYOUTS``) inside real
vLLM: `check` accepts each, greedy output with speculation equals the target's alone on
13 prompts of 1-250 tokens in one batch (windows of 16-24 tokens), and a batch mixing
greedy and T = 1 requests completes. Engines are shared with test_draft_fidelity.py
(helpers/layouts.py): one speculative engine per layout, one plain engine in all."""

import json

import pytest
from helpers import layouts


@pytest.mark.e2e
@pytest.mark.parametrize("layout", sorted(layouts.LAYOUTS))
def test_layout_passes_check_and_is_lossless(layout):
    conf = json.loads((layouts.drafter(layout) / "config.json").read_text())
    window = conf["dflash_config"].get("swa_window_size") or conf.get("sliding_window")
    if window is not None:  # the window must matter for these prompts
        assert window < max(len(p) for p in layouts.GREEDY_PROMPTS) // 4
    run = layouts.layout_run(layout)
    assert run["problems"] == []
    assert sum(len(s["req_ids"]) for s in run["steps"]) > 0  # it drafted
    assert run["greedy"] == layouts.plain_outputs()
    assert all(run["mixed_finished"])
    assert [len(o) for o in run["mixed"]] == [layouts.MIXED_MAX_TOKENS] * len(layouts.MIXED)
