"""Data-scaling curve tooling: ``vllm-dflash2 train --max-answer-tokens`` (a prefix of the
data in stored order) and ``benchmarks/scaling_curve.py`` end to end on a tiny target
(two points, real training children, real vLLM eval, resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.scripts import load_script

from vllm_dflash2.train import shards

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = [0, 3]
ANSWER = 20  # answer tokens of every sequence
RECIPE = ["--layers", "1", "--intermediate-size", "64", "--block-size", "4",
          "--conv-group-size", "8", "--selector-rank", "4", "--target-layer-ids", "0,3",
          "--mask-token-id", "5", "--candidate-vocab", "0", "--batch-seqs", "2",
          "--blocks-per-seq", "2", "--threads", "1", "--no-progress", "--max-steps", "2",
          "--eval-new-tokens", "8"]


def write_folder(root, target, first: int, num: int, shard_sequences: int = 2):
    """A data folder of ``num`` sequences (random prompt + answer ids, the tiny target's real
    features of them), prompts named ``s<first>``, ``s<first + 1>``, ... in stored order."""
    from transformers import AutoModelForCausalLM

    from vllm_dflash2.train.target import target_features

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(first)
    w = shards.ShardWriter(root, {"layer_ids": LAYERS, "feature_dim": 2 * model.config.hidden_size,
                                  "target": "tiny"}, {"command": f"test data {first}"},
                           shard_sequences=shard_sequences)
    for i in range(first, first + num):
        ids = torch.randint(10, model.config.vocab_size, (8 + ANSWER,), generator=g)
        with torch.no_grad():
            feats = target_features(model, ids[:-1].view(1, -1), LAYERS)[0]
        w.add({"tokens": ids, "feats": feats, "prompt_len": 8, "kind": ("code", "chat")[i % 2],
               "prompt": f"s{i}"})
    w.close()
    return root


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A peaked tiny target: a drafter sharing its lm_head proposes what it will accept, so
    a working eval reads tau well above 1 even after two training steps."""
    from vllm_dflash2.tools.tiny_models import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("curve_target"), peaked=5.0)


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("curve_data")
    return write_folder(root / "a", target, 0, 5), write_folder(root / "b", target, 5, 4)


def _prompts(seqs):
    return [s["prompt"] for s in seqs]


def test_max_answer_tokens_is_a_prefix(folders):
    """Whole sequences in stored order (folders as given, then shards, then sequences),
    the shortest prefix holding at least N answer tokens; a larger N extends a smaller one."""
    a, b = folders
    assert _prompts(shards.read_shards([a, b], max_answer_tokens=1)[0]) == ["s0"]
    assert _prompts(shards.read_shards([a, b], max_answer_tokens=ANSWER)[0]) == ["s0"]
    assert _prompts(shards.read_shards([a, b], max_answer_tokens=ANSWER + 1)[0]) == ["s0", "s1"]
    # across the folder boundary (a holds 5 sequences in 3 shards)
    first_six = shards.read_shards([a, b], max_answer_tokens=6 * ANSWER)[0]
    assert _prompts(first_six) == [f"s{i}" for i in range(6)]
    assert _prompts(shards.read_shards([b, a], max_answer_tokens=2 * ANSWER)[0]) == ["s5", "s6"]
    every = _prompts(shards.read_shards([a, b])[0])
    assert every == [f"s{i}" for i in range(9)]
    assert _prompts(shards.read_shards([a, b], max_answer_tokens=10**9)[0]) == every
    with pytest.raises(ValueError, match=r"max_answer_tokens=0: expected an integer >= 1"):
        shards.read_shards([a], max_answer_tokens=0)


def test_train_max_answer_tokens_refusals_and_summary(folders, target, tmp_path, capsys):
    from vllm_dflash2.train import cli

    a, b = folders
    common = ["--target", str(target), "--data", str(a), str(b), *RECIPE, "--max-steps", "1"]
    with pytest.raises(SystemExit, match=r"--max-answer-tokens=0: expected an integer >= 1"):
        cli.main(common + ["--out", str(tmp_path / "z"), "--max-answer-tokens", "0"])
    with pytest.raises(SystemExit,
                       match=r"--allow-less: expected together with --max-answer-tokens"):
        cli.main(common + ["--out", str(tmp_path / "z"), "--allow-less"])
    total = 9 * ANSWER
    short = (rf"--max-answer-tokens={total + 1}: the data folders hold only {total} answer "
             rf"tokens; expected at least {total + 1}")
    with pytest.raises(SystemExit, match=short):
        cli.main(common + ["--out", str(tmp_path / "z"), "--max-answer-tokens", str(total + 1)])
    assert not (tmp_path / "z" / "summary.json").exists()

    limit = 2 * ANSWER + 1
    assert cli.main(common + ["--out", str(tmp_path / "p"), "--max-answer-tokens", str(limit)]) == 0
    ds = json.loads((tmp_path / "p" / "summary.json").read_text())["dataset"]
    assert (ds["sequences"], ds["answer_tokens"], ds["max_answer_tokens"]) == (3, 3 * ANSWER, limit)
    assert ds["answer_tokens_available"] == total and ds["short_of_max_answer_tokens"] is False

    capsys.readouterr()
    assert cli.main(common + ["--out", str(tmp_path / "less"), "--max-answer-tokens",
                              str(total + 1), "--allow-less"]) == 0
    log = capsys.readouterr().out
    assert f"WARNING: --max-answer-tokens={total + 1} but the data holds only {total}" in log
    ds = json.loads((tmp_path / "less" / "summary.json").read_text())["dataset"]
    assert ds["answer_tokens"] == total and ds["short_of_max_answer_tokens"] is True


def _curve(*argv):
    script = os.path.join(REPO, "benchmarks", "scaling_curve.py")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, script, *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_scaling_curve_end_to_end_and_resume(folders, target, tmp_path):
    """Two points (the second crossing into the second folder), each trained by a child
    `vllm-dflash2 train` and evaluated by a child `vllm-dflash2 eval` on the tiny target;
    then the same command again trains and evaluates nothing."""
    a, b = folders
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):", "kind": "code"}) + "\n"
                       + json.dumps({"prompt": "Hello, how are you?", "kind": "chat"}) + "\n")
    out, work = tmp_path / "results" / "curve.json", tmp_path / "work"
    argv = ["--data", a, b, "--target", target, "--work", work,
            "--points", f"{6 * ANSWER},{3 * ANSWER}", "--offline-prompts", 2, "--k", 3,
            "--max-tokens", 8, "--concurrency", 2, "--prompts", prompts,
            "--max-model-len", 256, "--vllm-points", 3 * ANSWER,
            "--dtype", "float32", "--out", out, "--", *RECIPE]
    _curve(*argv)
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32" and "cpu_flags" in result
    run = result["runs"]["base"]
    assert list(run["points"]) == [str(3 * ANSWER), str(6 * ANSWER)]  # sorted
    small, large = run["points"][str(3 * ANSWER)], run["points"][str(6 * ANSWER)]
    assert (small["answer_tokens"], large["answer_tokens"]) == (3 * ANSWER, 6 * ANSWER)
    assert (small["sequences"], large["sequences"]) == (3, 6)
    # the larger point's data holds the smaller one's: its training read the same prefix, longer
    for point, rec in ((3 * ANSWER, small), (6 * ANSWER, large)):
        summary = json.loads((work / "base" / f"p{point}" / "summary.json").read_text())
        assert f"--max-answer-tokens {point}" in summary["variants"]["dflash2"]["command"]
        assert summary["dataset"]["sequences"] == rec["sequences"]
        card = (work / "base" / f"p{point}" / "drafter" / "README.md").read_text()
        assert f"Trained on the first {point} answer tokens of the data folders' 180" in card
    p_small = _prompts(shards.read_shards([a, b], max_answer_tokens=3 * ANSWER)[0])
    p_large = _prompts(shards.read_shards([a, b], max_answer_tokens=6 * ANSWER)[0])
    assert p_large[:len(p_small)] == p_small and len(p_large) > len(p_small)
    # one vLLM engine keeps the test short: the small point through vLLM, the large one offline
    assert set(small["tau"]) == {"T0/code", "T0/chat", "T1/code", "T1/chat"} and "tau" not in large
    assert all(1.0 <= t <= 4.0 for t in small["tau"].values()), small["tau"]
    assert small["tau"]["T0/code"] > 2 and small["tau"]["T0/chat"] > 2, small["tau"]
    assert all(len(p) == 3 for p in small["acceptance_per_pos"].values())
    for rec in (small, large):
        assert rec["steps"] == 2 and rec["train_seconds"] > 0
        assert set(rec["offline_tau"]) >= {"code", "chat"}
        assert all(2.0 < t <= 4.0 for t in rec["offline_tau"].values()), rec["offline_tau"]
    cmds = [c["command"] for c in run["commands"]]
    assert len(cmds) == 3 and [c.split()[1] for c in cmds] == ["train", "eval", "train"]
    assert all(str(tmp_path) not in c for c in cmds)  # placeholders, not this machine's folders
    assert any("--num-speculative-tokens 3" in c and "--temperatures 0,1" in c for c in cmds)
    # a trend needs two points: the offline lines have them, the vLLM lines (one point) not
    assert set(run["extrapolation"]) == {"offline/code", "offline/chat"}
    assert all(f["points"] == 2 for f in run["extrapolation"].values())
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def stamps():
        return [(work / "base" / f"p{p}" / name).stat().st_mtime_ns
                for p in (3 * ANSWER, 6 * ANSWER)
                for name in ("summary.json", "drafter/config.json")]

    before = stamps()
    again = _curve(*argv)
    assert again.count("trained already: skipped") == 2
    assert again.count("evaluated already: skipped") == 1
    assert json.loads(out.read_text())["runs"]["base"]["commands"] == run["commands"]
    assert stamps() == before


def test_extrapolation_fits_tau_per_doubling_and_the_data_a_floor_needs(tmp_path):
    """The trend is a least-squares line in log2(tokens): three points on an exact line give
    its slope and the tokens at its floor; a flat or falling line needs no amount of data."""
    sc = load_script(os.path.join(REPO, "benchmarks", "scaling_curve.py"), "scaling_curve")

    def point(tokens, code, chat, off_code, off_chat):
        return {"answer_tokens": tokens, "max_answer_tokens": tokens,
                "tau": {"T0/code": code, "T0/chat": chat, "T1/code": 1.5, "T1/chat": 1.3},
                "offline_tau": {"code": off_code, "chat": off_chat}}

    run = {"points": {str(t): point(t, 1.9 + 0.2 * i, 1.5 - 0.01 * i, 1.8 + 0.1 * i, 1.4)
                      for i, t in enumerate((1000, 2000, 4000))}}
    fits = sc.extrapolate(run)
    assert fits["T0/code"]["per_doubling"] == pytest.approx(0.2) and fits["T0/code"]["points"] == 3
    # 1.9 at 1000 tokens, +0.2 per doubling: 2.5 after 3 doublings
    assert fits["T0/code"]["answer_tokens_for_floor"] == pytest.approx(8000, rel=1e-6)
    # the offline line is judged against the greedy floor (it is the float32 greedy tau)
    assert fits["offline/code"]["floor"] == sc.FLOORS["code"]["T0"]
    assert fits["offline/code"]["answer_tokens_for_floor"] == pytest.approx(1000 * 2 ** 7, rel=1e-6)
    assert fits["T0/chat"]["per_doubling"] < 0 and fits["T0/chat"]["answer_tokens_for_floor"] is None
    assert fits["offline/chat"]["answer_tokens_for_floor"] is None  # flat: data alone never gets there
    assert "T1/code" in fits and fits["T1/code"]["answer_tokens_for_floor"] is None
    one = {"points": {"1000": point(1000, 1.9, 1.5, 1.8, 1.4)}}
    assert sc.extrapolate(one) == {}  # one point is no trend
    same = {"points": {"1000": point(1000, 1.9, 1.5, 1.8, 1.4), "2000": point(1000, 2.0, 1.6, 1.9, 1.5)}}
    assert sc.extrapolate(same) == {}  # two points short of data at one size: no slope
    run["extrapolation"] = fits
    png = tmp_path / "c.png"
    sc.plot({"runs": {"base": run}}, png)  # the trend line drawn out to its floor
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
