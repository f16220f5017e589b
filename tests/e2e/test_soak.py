"""benchmarks/soak.py: its verdict logic, and a short soak of a real server.

The short soak sends the whole mix (greedy and T = 1 with top-p / top-k / seeds, n = 2,
prompts from 1 token to longer than the prefill chunk, streamed and not, stop strings,
client disconnects mid-stream) to ``vllm-dflash2 serve`` with a tiny target and a drafter
whose drafts get accepted, for a few hundred engine steps: no request may fail, the
server must answer at the end, and the JSON must hold what the long soak is judged on.
"""

import json
import os
from pathlib import Path

import pytest
from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
soak = load_script(REPO / "benchmarks" / "soak.py", "soak")


def _samples(rss: list[float], lengths: list[float | None]):
    return [{"t_s": 60.0 * i, "rss_mib": {"engine[1]": r}, "accept_length": a,
             "drafts": 100 if a else 0} for i, (r, a) in enumerate(zip(rss, lengths))]


def _result(samples, errors=0, steps=500.0, healthy=True, length=1.6):
    return {"samples": samples, "totals": {"steps": steps, "errors": errors,
                                           "healthy_at_end": healthy, "accept_length": length}}


def test_rss_growth_counts_from_the_end_of_warm_up():
    samples = _samples([100, 200, 1000, 1010, 1040], [1.6] * 5)
    growth = soak.rss_growth(samples, warmup_s=120)
    assert growth == {"engine[1]": pytest.approx(0.04)}
    # A process that left before the end is reported, not silently dropped.
    samples[-1]["rss_mib"] = {"engine[2]": 1000}
    assert soak.rss_growth(samples, warmup_s=120) == {"engine[1]": None}


def test_verdict_fails_on_each_of_its_conditions():
    good = _samples([1000, 1000, 1010, 1020], [1.6, 1.5, 1.7, 1.6])
    assert soak.verdict(_result(good), min_steps=400, warmup_s=60)["ok"]
    assert not soak.verdict(_result(good, steps=399), 400, 60)["steps"]
    assert not soak.verdict(_result(good, errors=1), 400, 60)["no_failed_requests"]
    assert not soak.verdict(_result(good, healthy=False), 400, 60)["server_healthy_at_end"]
    leaking = _samples([1000, 1000, 1030, 1060], [1.6] * 4)
    assert not soak.verdict(_result(leaking), 400, 60)["rss_growth_under_5pct"]
    collapsing = _samples([1000] * 4, [1.6, 1.6, 1.6, 1.2])  # below 1 + half of 0.6
    assert not soak.verdict(_result(collapsing), 400, 60)["acceptance_steady"]


def test_check_answer_catches_malformed_answers():
    body = {"n": 2, "max_tokens": 8}
    ok = {"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}],
          "usage": {"completion_tokens": 12}}
    assert soak.check_answer(ok, body) is None
    assert "choices" in soak.check_answer({"choices": ok["choices"][:1]}, body)
    bad = {"choices": [{"finish_reason": "abort"}, {"finish_reason": "stop"}]}
    assert "finish_reason" in soak.check_answer(bad, body)
    assert "completion tokens" in soak.check_answer(dict(ok, usage={"completion_tokens": 17}),
                                                    body)


@pytest.mark.e2e
def test_short_soak_of_a_real_server(tmp_path):
    from vllm_dflash2.tools.tiny_models import build_peaked_drafter, build_tiny_target

    target = build_tiny_target(tmp_path / "target", peaked=4.0)
    drafter = build_peaked_drafter(tmp_path / "drafter", target)
    out = tmp_path / "soak.json"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    code = soak.main(["--target", str(target), "--drafter", str(drafter),
                      "--concurrency", "8", "--min-steps", "300", "--max-minutes", "6",
                      "--chunk", "64", "--max-model-len", "1024", "--sample-seconds", "5",
                      "--warmup-seconds", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    totals, verdict = result["totals"], result["verdict"]
    assert result["errors"] == [] and totals["errors"] == 0, result["errors"]
    assert totals["healthy_at_end"] and totals["steps"] >= 300
    assert totals["completed"] > 0 and totals["accept_length"] > 1.0
    assert len(result["samples"]) >= 2
    assert all(s["rss_mib"] for s in result["samples"])
    sent = totals["sent_by_kind"]
    assert any(k.startswith("long/") for k in sent), sent  # split prefills were sent
    assert any("T1" in k for k in sent) and any("greedy" in k for k in sent)
    assert out.with_suffix(".png").is_file()
    # RSS growth after a few seconds of a tiny model is no verdict; the rest is.
    assert code == (0 if verdict["ok"] else 1)
    assert verdict["no_failed_requests"] and verdict["server_healthy_at_end"] and verdict["steps"]
