"""Drafter fidelity: the drafts vLLM's V1 DFlash2 proposer makes for each published
layout equal those of an independent pure-PyTorch reference of the whole draft pass
(helpers/fidelity.py: HF target features, ``train.drafter`` built from the checkpoint's
config fields, the reference walk). Greedy drafts token for token; sampled drafts
(seeded T = 1) token for token and the sparse q the rejection sampler got within
float32 tolerance. Losslessness cannot see these bugs: a drafter whose window or
softcap is ignored still gives correct output, only slower.

Each field must bite: the reference with that one field neutralized disagrees with
vLLM's drafts (so vLLM ignoring the field would fail the first test).
"""

import pytest
from helpers import fidelity, layouts


@pytest.mark.e2e
@pytest.mark.parametrize("layout", sorted(layouts.LAYOUTS))
def test_drafts_match_the_reference(layout):
    stats = fidelity.compare(layout, layouts.layout_run(layout))
    assert stats["drafts"] >= 100 and stats["sampled"] >= 10, stats
    assert stats["mismatch"] == [], stats["mismatch"][:3]
    assert stats["near_ties"] <= 0.02 * stats["drafts"], stats
    assert stats["q_err"] <= fidelity.Q_ATOL, stats


def _no_window(m):
    for layer in m.layers:
        layer.self_attn.window = None


def _window_plus_one(m):  # the boundary: W keys up to the query's own position, not W + 1
    for layer in m.layers:
        layer.self_attn.window += 1


def _not_causal(m):
    for layer in m.layers:
        layer.self_attn.causal = False


def _no_sink(m):
    for layer in m.layers:
        layer.self_attn.attention_sink_bias = None


def _no_value_scale(m):
    for layer in m.layers:
        layer.self_attn.v_scale = None


def _set(field, value):
    return lambda m: setattr(m.cfg, field, value)


def _no_d2t(m):
    m.d2t.zero_()


BREAKS = {
    "swa": {"window": _no_window, "window_boundary": _window_plus_one},
    "sliding_causal": {"window": _no_window, "window_boundary": _window_plus_one,
                       "causal": _not_causal},
    "head_scales": {"softcap": _set("final_logit_softcapping", None),
                    "multiplier": _set("output_multiplier", 1.0),
                    "embedding_scale": _set("input_embedding_scale", 1.0)},
    "sink_vscale": {"sink": _no_sink, "value_scale": _no_value_scale},
    "draft_vocab": {"d2t": _no_d2t},
    "deep": {"last_layer_dropped": lambda m: m.layers.__delitem__(-1)},
}


@pytest.mark.e2e
@pytest.mark.parametrize("layout, field", [(l, f) for l, fs in BREAKS.items() for f in fs])
def test_each_field_bites(layout, field):
    model = fidelity.reference_drafter(layouts.drafter(layout))
    BREAKS[layout][field](model)
    stats = fidelity.compare(layout, layouts.layout_run(layout), model=model)
    assert stats["mismatch"] or stats["q_err"] > 100 * fidelity.Q_ATOL, stats
