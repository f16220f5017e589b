"""`vllm-dflash2 datagen`: vLLM's captured features against Hugging Face's, both engines
writing the same data, resume after a kill, refusals (tiny random target, real engines)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from vllm_dflash2.train import datagen, shards

LAYERS = [0, 2, 3]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*argv) -> list[str]:
    return [sys.executable, "-m", "vllm_dflash2.train.datagen", *map(str, argv)]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _common(target, out, **kw) -> list:
    opts = {"--out": out, "--target": target, "--num-prompts": 6, "--max-new-tokens": 16,
            "--max-prompt-new-tokens": 12, "--dtype": "float32", "--target-layer-ids": "0,2,3",
            "--max-model-len": 256, "--shard-sequences": 2, "--teacher-top-n": 4, "--concurrency": 4,
            "--batch-size": 4, "--min-prompt-words": 1, **kw}
    args = [x for k, v in opts.items() for x in (k, v)]
    return [*args, "--enforce-eager", "--no-progress"]


# ---------------------------------------------------------------------------------------
# vLLM float32 capture == HF float32 features of the same tokens

_CHILD = r"""
import sys, torch
from types import SimpleNamespace
from transformers import AutoTokenizer
from vllm_dflash2.train import vllm_generation
from vllm_dflash2.train.prompts import Job, chat_ids, user_turn_parts
target, out = sys.argv[1], sys.argv[2]
args = SimpleNamespace(target=target, dtype="float32", tensor_parallel_size=1, max_model_len=256,
                       concurrency=4, seed=0, enforce_eager=True, teacher_top_n=4, handoff="memory",
                       max_new_tokens=20, max_prompt_new_tokens=12, temperature=1.0, top_p=0.95,
                       min_prompt_words=0, min_answer_tokens=1)
tok = AutoTokenizer.from_pretrained(target)
head, _ = user_turn_parts(tok)
jobs = [(0, Job(chat_ids(tok, "def add(a, b): return the sum"), "code", prompt="p0")),
        (1, Job(chat_ids(tok, "Hello! How can I help you today?"), "chat", prompt="p1")),
        (2, Job(tok(head + "Write", add_special_tokens=False)["input_ids"], "chat",
                self_instruct=True, opener="Write"))]
stats = {"dropped_held_out": 0, "dropped_short": 0}
llm = vllm_generation.build_llm(args, [0, 2, 3], "/nonexistent-unused")
scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core
scheduled, schedule = [], scheduler.schedule
def counting(*a, **k):
    output = schedule(*a, **k)
    scheduled.append(sum(map(len, output.scheduled_spec_decode_tokens.values())))
    return output
scheduler.schedule = counting
seqs = [s for s in vllm_generation.vllm_sequences(llm, tok, jobs, args, [], stats) if "dropped" not in s]
torch.save({"seqs": seqs, "spec_tokens": sum(scheduled), "steps": len(scheduled)}, out)
"""


@pytest.mark.e2e
def test_vllm_features_and_soft_labels_match_hf_float32(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from helpers.probes import run_in_process_engine
    from vllm_dflash2.train.target import target_features

    out = tmp_path / "seqs.pt"
    run_in_process_engine(_CHILD, tiny_target, out)
    got = torch.load(out)
    seqs = got["seqs"]
    assert sorted(s["job"] for s in seqs) == [0, 1, 2]
    # No step verified a dummy draft token (patches: ExtractHiddenStatesProposer.propose):
    # upstream schedules one per request and decode step.
    assert got["steps"] > 20 and got["spec_tokens"] == 0, got
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for s in seqs:
        tokens, p = s["tokens"].long(), s["prompt_len"]
        assert s["feats"].dtype == torch.float32 and s["feats"].shape == (len(tokens) - 1, 3 * 64)
        ref = target_features(hf, tokens[:-1].view(1, -1), LAYERS)[0]
        rel = (s["feats"] - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"job {s['job']}: features differ from HF by {rel:.2e} (relative)"
        with torch.no_grad():
            logp = torch.log_softmax(hf(tokens.view(1, -1)).logits[0, :-1].float(), -1)
        top_lp, top_ids = logp.topk(4, dim=-1)
        # Answer rows (from the last prompt token on): vLLM's logprobs are HF's top-4.
        assert torch.equal(s["teacher_ids"][p - 1:].long(), top_ids[p - 1:])
        torch.testing.assert_close(s["teacher_logp"][p - 1:].float(), top_lp[p - 1:], atol=2e-3, rtol=0)
        # Greedy: each answer token is the argmax after the token before it.
        assert torch.equal(tokens[p:], top_ids[p - 1:, 0])
        # Prompt rows are left empty (documented), the rest is all filled.
        assert (s["teacher_ids"][: p - 1] == -1).all() and torch.isinf(s["teacher_logp"][: p - 1]).all()
        assert (s["teacher_ids"][p - 1:] >= 0).all()


# ---------------------------------------------------------------------------------------
# Both engines through the CLI: same format, same features for the same tokens

@pytest.mark.e2e
def test_both_engines_write_the_same_data(tiny_target, tmp_path):
    got = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        # stdlib prompts only: both engines answer the very same prompt tokens.
        proc = subprocess.run(_cli(*_common(tiny_target, out, **{"--stdlib-fraction": 1.0}),
                                   "--engine", engine),
                              env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[engine] = shards.read_shards(out)
    (hf, hf_head), (vl, vl_head) = got["hf"], got["vllm"]
    for head in (hf_head, vl_head):
        assert head["layer_ids"] == LAYERS and head["feature_dim"] == 3 * 64 and head["teacher_top_n"] == 4
    assert hf_head["runs"][0]["engine"] == "hf" and vl_head["runs"][0]["engine"] == "vllm"
    assert "--engine vllm" in vl_head["runs"][0]["command"]
    assert len(vl) == len(hf) >= 4
    assert sorted(s["job"] for s in vl) == sorted({s["job"] for s in vl})
    by_prompt = {s["prompt"]: s for s in hf}
    same = 0
    for s in vl:
        h = by_prompt[s["prompt"]]
        assert s["prompt_len"] == h["prompt_len"]
        if not torch.equal(s["tokens"], h["tokens"]):
            continue  # a greedy near-tie may branch; the rest must agree
        same += 1
        a, b = s["feats"].float(), h["feats"].float()
        # Both stored bf16 (8 mantissa bits): agree to bf16 rounding.
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()
        p = s["prompt_len"]
        assert torch.equal(s["teacher_ids"][p - 1:], h["teacher_ids"][p - 1:])
        torch.testing.assert_close(s["teacher_logp"][p - 1:].float(), h["teacher_logp"][p - 1:].float(),
                                   atol=5e-3, rtol=0)
    assert same >= len(vl) - 1, f"only {same} of {len(vl)} sequences have the same tokens"


# ---------------------------------------------------------------------------------------
# Kill and restart: nothing written twice, nothing lost, the same sequences

def _by_job(root) -> dict[int, dict]:
    seqs, _ = shards.read_shards(root)
    jobs = [s["job"] for s in seqs]
    assert len(jobs) == len(set(jobs)), f"a prompt was written twice: {sorted(jobs)}"
    return {s["job"]: s for s in seqs}


@pytest.mark.e2e
def test_killed_run_resumes_without_duplicates_or_losses(tiny_target, tmp_path):
    n = 16
    # One request at a time: the run is still going when its first shard lands.
    argv = _common(tiny_target, tmp_path / "killed", **{"--num-prompts": n, "--concurrency": 1})
    proc = subprocess.Popen(_cli(*argv), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    manifest = tmp_path / "killed" / "manifest.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if manifest.is_file() and json.loads(manifest.read_text())["shards"]:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stderr.read()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = shards.settled_jobs(tmp_path / "killed")
    assert 0 < len(before) < n
    proc = subprocess.run(_cli(*argv), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{len(before)} already done" in proc.stderr
    assert shards.settled_jobs(tmp_path / "killed") == set(range(n))
    resumed = _by_job(tmp_path / "killed")
    # The uninterrupted run hands features over by file (engine core in its own process).
    proc = subprocess.run(_cli(*_common(tiny_target, tmp_path / "clean",
                                        **{"--num-prompts": n, "--concurrency": 1, "--handoff": "file"})),
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    clean = _by_job(tmp_path / "clean")
    # Per-prompt seeds: the resumed folder holds exactly the uninterrupted run's sequences.
    assert resumed.keys() == clean.keys()
    for job, seq in clean.items():
        assert torch.equal(resumed[job]["tokens"], seq["tokens"]), f"prompt {job} differs after the restart"
        torch.testing.assert_close(resumed[job]["feats"].float(), seq["feats"].float(), atol=1e-2, rtol=1e-2)
    m = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert len(m["runs"]) == 2 and m["runs"][1]["resumed_after_jobs"] == len(before)


# ---------------------------------------------------------------------------------------
# Refusals: before anything starts, naming the field, the value and what was expected

@pytest.mark.parametrize("extra, message", [
    (["--num-prompts", "0"], "--num-prompts=0: expected an integer >= 1"),
    (["--top-p", "1.5"], "--top-p=1.5: expected a value in (0, 1]"),
    (["--stdlib-fraction", "-0.1"], "--stdlib-fraction=-0.1: expected a fraction in [0, 1]"),
    (["--target-layer-ids", "0,9"], "--target-layer-ids='0,9': expected distinct layer indices in [0, 3]"),
    (["--target-layer-ids", "a"], "--target-layer-ids='a': expected comma-separated integers"),
    (["--handoff", "memory", "--tensor-parallel-size", "2"], "--handoff='memory': expected file"),
    (["--engine", "hf", "--tensor-parallel-size", "2"], "--tensor-parallel-size=2: expected 1 with --engine hf"),
    (["--teacher-top-n", "0"], "--teacher-top-n=0: expected an integer in [1, 128]"),
])
def test_refusals(tiny_target, tmp_path, capsys, extra, message):
    rc = datagen.main(["--out", str(tmp_path / "d"), "--target", str(tiny_target), *extra])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_refusals_of_folder_and_target(tiny_target, tmp_path, capsys):
    assert datagen.main(["--out", str(tmp_path / "d"), "--target", str(tmp_path / "nothing")]) == 2
    assert f"--target={str(tmp_path / 'nothing')!r}: expected an HF model folder" in capsys.readouterr().err
    # An existing folder holds other taps / another prompt plan: appending would mix data.
    header = {"layer_ids": [1, 2], "feature_dim": 128, "teacher_top_n": 16,
              "jobs": {"num_prompts": 512, "seed": 0, "code_fraction": 0.5, "stdlib_fraction": 0.15,
                       "max_new_tokens": 256, "max_prompt_new_tokens": 64}}
    shards.ShardWriter(tmp_path / "d", header).close()
    base = ["--out", str(tmp_path / "d"), "--target", str(tiny_target)]
    assert datagen.main([*base, "--target-layer-ids", "0,3"]) == 2
    assert "--target-layer-ids=[0, 3]: expected layer_ids=[1, 2] as in the existing data folder" in capsys.readouterr().err
    assert datagen.main([*base, "--target-layer-ids", "1,2", "--seed", "7"]) == 2
    assert "--seed=7: expected 0 to resume" in capsys.readouterr().err


def test_cli_dispatches_datagen(tmp_path, capsys):
    from vllm_dflash2.cli import main

    assert main(["datagen", "--out", str(tmp_path / "d"), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens=0: expected an integer >= 1" in capsys.readouterr().err


def test_hf_engine_resumes_a_lost_chunk_with_its_seed(tiny_target, tmp_path, capsys):
    """The fallback settles prompts a chunk (= one shard) at a time: a shard lost to a kill
    is redone with that chunk's seed, the same sequences again, nothing else."""
    argv = ["--engine", "hf", *map(str, _common(tiny_target, tmp_path / "d"))]
    assert datagen.main(argv) == 0
    first = shards.read_shards(tmp_path / "d")[0]
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert len(m["shards"]) == 3 and shards.settled_jobs(tmp_path / "d") == set(range(6))
    lost = m["shards"].pop()  # killed before the last shard reached the manifest
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    assert shards.settled_jobs(tmp_path / "d") == set(range(4))
    assert datagen.main(argv) == 0
    assert "4 already done" in capsys.readouterr().err
    again = shards.read_shards(tmp_path / "d")[0]
    assert len(again) == len(first) and shards.settled_jobs(tmp_path / "d") == set(range(6))
    for a, b in zip(first, again):
        assert a["prompt"] == b["prompt"] and torch.equal(a["tokens"], b["tokens"])
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["shards"][-1]["file"] == lost["file"]
