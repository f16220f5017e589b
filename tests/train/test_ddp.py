"""Data-parallel training: 2 processes under torchrun (gloo, CPU) take the same optimizer
steps as 1 process on the same global batch, resuming a checkpoint another world size wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train_pipeline import write_data

ROOT = Path(__file__).resolve().parents[2]
# float32 on both sides; a 2-rank mean of two micro-batch gradients and the 1-process
# accumulation of the same two differ only by summation order (none at 2 ranks).
ATOL, RTOL = 1e-6, 1e-5


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for i, s in state["opt"]["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items() if torch.is_tensor(v)})
    return out


def test_two_ranks_take_the_steps_of_one_process(tmp_path):
    from vllm_dflash2.tools.tiny_models import build_tiny_target
    from vllm_dflash2.train import cli

    tpath = build_tiny_target(tmp_path / "t", hidden_size=64, num_layers=4, seed=2)
    data = write_data(tmp_path / "data", tpath, [0, 3], num=8, max_new_tokens=12, shard_sequences=3)
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    common = ["--target", str(tpath), "--data", str(data), "--layers", "1", "--intermediate-size", "64",
              "--block-size", "4", "--conv-group-size", "8", "--selector-rank", "4",
              "--target-layer-ids", "0,3", "--mask-token-id", "5", "--candidate-vocab", "96",
              "--batch-seqs", "4", "--micro-batch-seqs", "2", "--blocks-per-seq", "3", "--lr", "3e-3",
              "--ckpt-every", "100", "--threads", "1", "--no-progress"]
    # 2 steps in 1 process, then the same checkpoint goes on to step 5 with 2 ranks and with 1.
    assert cli.main(common + ["--out", str(ddp), "--max-steps", "2"]) == 0
    at2 = torch.load(ddp / "ckpt_dflash2.pt", weights_only=False)
    shutil.copytree(ddp, single)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "vllm_dflash2.train", *common, "--out", str(ddp), "--max-steps", "5"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("resumed dflash2 at step 2 (world 2, micro-batches of 2)") == 1  # rank 0 logs
    assert cli.main(common + ["--out", str(single), "--max-steps", "5"]) == 0

    a = torch.load(ddp / "ckpt_dflash2.pt", weights_only=False)
    b = torch.load(single / "ckpt_dflash2.pt", weights_only=False)
    assert a["state"]["step"] == b["state"]["step"] == 5
    fa, fb, f2 = _flat(a), _flat(b), _flat(at2)
    assert fa.keys() == fb.keys() and len(fa) > 20
    moved = max(float((fb[k] - f2[k]).abs().max()) for k in f2 if k.startswith("model."))
    assert moved > 100 * ATOL  # the three steps changed the parameters: equality is not vacuous
    worst = {k: float((fa[k].float() - fb[k].float()).abs().max()) for k in fa}
    for k in fa:
        torch.testing.assert_close(fa[k], fb[k], atol=ATOL, rtol=RTOL, msg=lambda m, k=k: f"{k}: {m}")
    print(f"largest difference 2 ranks vs 1 process: {max(worst.values()):.3g}")
    ha = json.loads((ddp / "history_dflash2.json").read_text())
    hb = json.loads((single / "history_dflash2.json").read_text())
    assert [h["step"] for h in ha] == [1, 2, 3, 4, 5]
    for x, y in zip(ha, hb):  # the logged metrics are the global batch's, not rank 0's share
        assert {k: v for k, v in x.items() if k != "t"} == pytest.approx(
            {k: v for k, v in y.items() if k != "t"}, abs=2e-4)
    summary = json.loads((ddp / "summary.json").read_text())["variants"]["dflash2"]
    assert summary["world"] == 2 and summary["micro_batch_seqs"] == 2
