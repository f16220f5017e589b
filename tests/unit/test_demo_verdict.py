"""The demo's greedy-equality judge (examples/verdict.py): a near-tie within the dtype's
resolution passes, anything else fails. Self-contained: loads the module by path."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_verdict():
    for parent in Path(__file__).resolve().parents:
        path = parent / "examples" / "verdict.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("demo_verdict", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up there
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError("examples/verdict.py not found above this test")


V = _load_verdict()


def test_ulp_matches_torch_spacing():
    torch = pytest.importorskip("torch")
    for x in (0.3, 1.0, 1.5, 17.25, -23.0, 100.0):
        for dtype, tdtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32),
                              ("float16", torch.float16)):
            t = torch.tensor(abs(x), dtype=tdtype)
            nxt = torch.nextafter(t, torch.tensor(float("inf"), dtype=tdtype))
            assert V.ulp(x, dtype) == pytest.approx(float(nxt - t)), (x, dtype)


def test_ulp_rejects_unknown_dtype_naming_it():
    with pytest.raises(ValueError, match="dtype='int8'"):
        V.ulp(1.0, "int8")


def test_first_divergence():
    assert V.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert V.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert V.first_divergence([1, 2, 3], [1, 2]) == 2


def test_tie_within_bf16_resolution_passes():
    # |logit| in [16, 32): a bf16 ulp is 0.125; one ulp apart is a near-tie.
    v = V.judge(10, 20, {10: 18.125, 20: 18.0}, "bfloat16")
    assert v.near_tie, v.reason
    assert v.gap == pytest.approx(0.125)
    assert v.tolerance == pytest.approx(V.TIE_ULPS * 0.125)
    assert V.judge(10, 20, {10: 18.0, 20: 18.0}, "bfloat16").near_tie  # exact tie


def test_clear_gap_fails():
    v = V.judge(10, 20, {10: 19.0, 20: 18.0}, "bfloat16")  # 8 ulps
    assert not v.near_tie and "gap" in v.reason


def test_same_gap_is_a_bug_in_float32():
    assert not V.judge(10, 20, {10: 18.125, 20: 18.0}, "float32").near_tie


def test_tolerance_scales_with_the_logits_magnitude():
    # 0.125 is one ulp at 18 but eight at 2.5 (ulp 2**-6)
    assert V.judge(10, 20, {10: 18.125, 20: 18.0}, "bfloat16").near_tie
    assert not V.judge(10, 20, {10: 2.625, 20: 2.5}, "bfloat16").near_tie


def test_token_outside_the_top_logits_fails():
    v = V.judge(10, 30, {10: 18.125, 20: 18.0}, "bfloat16")
    assert not v.near_tie and "top 2" in v.reason


def test_third_choice_within_tolerance_is_a_near_tie():
    # seen in bf16: '\n' 21.125, ' The' 21.0, end-of-text 20.75 (3 ulps below the top)
    top = {198: 21.125, 378: 21.0, 2: 20.75, 3717: 20.5}
    v = V.judge(198, 2, top, "bfloat16")
    assert v.near_tie, v.reason
    assert v.gap == pytest.approx(0.375)
    # the same rank, 5 ulps below the top, is not
    assert not V.judge(198, 2, {198: 21.125, 378: 21.0, 2: 20.5}, "bfloat16").near_tie


def test_ended_output_fails():
    assert not V.judge(10, None, {10: 18.0, 20: 18.0}, "bfloat16").near_tie
