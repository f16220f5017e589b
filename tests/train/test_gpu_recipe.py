"""The GPU recipe (recipes/gpu) end to end on the CPU with a tiny target: the pieces a call
carries, the run's stages under its wall-clock plan, and the split export's reassembly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "recipes" / "gpu" / "run.sh"


@pytest.fixture(scope="module")
def driver():
    return load_script(ROOT / "recipes" / "gpu" / "driver.py", "gpu_recipe_driver")


def test_pieces_verify_and_reassemble(tmp_path, driver):
    """prepare cuts a file into pieces with sha256; check (through run.sh) names what is
    missing or damaged; a run refuses damaged pieces before anything starts."""
    src = tmp_path / "model.gguf"
    src.write_bytes(torch.randint(0, 256, (300_000,), dtype=torch.uint8).numpy().tobytes())
    pieces = tmp_path / "pieces"
    assert driver.main(["prepare", "--pieces", str(pieces), "--gguf", str(src), "--piece-mb", "0.1",
                        "--no-wheel"]) == 0
    m = json.loads((pieces / "pieces.json").read_text())
    assert [p["size"] for p in m["pieces"]] == [104857, 104857, 90286]
    assert m["size"] == 300_000 and m["sha256"] == driver.sha256(src)
    env = {"DFLASH2_RECIPE_PIECES": str(pieces), "PATH": "/usr/bin:/bin", "PYTHON": driver.sys.executable}
    check = subprocess.run(["bash", str(RUN_SH), "--check"], env=env, capture_output=True, text=True)
    assert check.returncode == 0 and "3/3 pieces present and intact" in check.stdout, check.stderr
    out = driver.join(pieces, m["pieces"], tmp_path / "joined.gguf", m["sha256"])
    assert out.read_bytes() == src.read_bytes()

    (pieces / "model.gguf.part-02").unlink()
    data = bytearray((pieces / "model.gguf.part-01").read_bytes())
    data[7] ^= 1
    (pieces / "model.gguf.part-01").write_bytes(bytes(data))
    check = subprocess.run(["bash", str(RUN_SH), "--check"], env=env, capture_output=True, text=True)
    assert check.returncode == 3
    assert "1/3 pieces" in check.stdout and "part-01: sha256 differs" in check.stdout
    assert "part-02: missing" in check.stdout
    with pytest.raises(SystemExit, match=r"part-01: sha256 differs.*part-02: missing"):
        driver.main(["run", "--pieces", str(pieces), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])


def test_recipe_runs_end_to_end_on_cpu(tmp_path, driver, capsys):
    """Datagen into a shard folder, training, offline tau, an export cut into files of at most
    --max-file-mb that rejoin into the trained drafter; the plan is printed first."""
    from vllm_dflash2.tools.tiny_models import build_tiny_target
    from vllm_dflash2.train.drafter import load_native

    tpath = build_tiny_target(tmp_path / "t", hidden_size=64, num_layers=4, seed=2)
    work, out = tmp_path / "work", tmp_path / "out"
    tiny = ["--target", str(tpath), "--work", str(work), "--out", str(out), "--minutes", "5",
            "--jobs", "6", "--chunk-jobs", "3", "--gen-batch-size", "3", "--max-new-tokens", "12",
            "--shard-sequences", "2", "--layers", "1", "--intermediate-size", "64", "--batch-seqs", "2",
            "--blocks-per-seq", "2", "--max-steps", "3", "--eval-prompts", "2", "--eval-new-tokens", "8",
            "--threads", "1", "--max-file-mb", "0.05", "--",
            "--block-size", "4", "--conv-group-size", "8", "--selector-rank", "4", "--target-layer-ids", "0,3",
            "--mask-token-id", "5", "--candidate-vocab", "96"]
    assert driver.main(["run", *tiny]) == 0
    log = capsys.readouterr().out
    assert log.index("wall-clock plan (5 min)") < log.index("== setup") < log.index("== datagen")
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["layer_ids"] == [0, 3] and len(manifest["shards"]) >= 2
    assert manifest["runs"][0]["jobs"] == 6 and manifest["runs"][0]["chunks"] == 2

    rec = json.loads((out / "recipe.json").read_text())
    assert set(rec["timing"]["took_s"]) == {"setup", "datagen", "train", "eval", "export"}
    assert rec["summary"]["variants"]["dflash2"]["steps"] == 3
    assert rec["summary"]["variants"]["dflash2"]["offline_tau"]["all"]["tau"] >= 1.0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 50_000 for f in files)
    parts = [f for f in files if f.startswith("model.safetensors.part-")]
    assert len(parts) >= 2 and "model.safetensors" not in files

    assert driver.main(["join", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == (work / "smollm2-135m-instruct-dflash2" / "model.safetensors").read_bytes()
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    back, ref = load_native(out), load_native(work / "smollm2-135m-instruct-dflash2")
    for (k, a), (_, b) in zip(back.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    assert json.loads((out / "config.json").read_text())["vllm_dflash2_candidate_vocab"] == "candidate_vocab.json"


def test_on_device_adapter_keeps_generation_identical(tmp_path, driver):
    """The adapter that runs ``generate_dataset`` with the target on a GPU, exercised with the
    CPU as the device: same sequences, features and soft labels; the lm_head is restored."""
    from vllm_dflash2.tools.tiny_models import build_tiny_target
    from vllm_dflash2.train.hf_generation import generate_dataset
    from vllm_dflash2.train.prompts import make_jobs
    from vllm_dflash2.train.target import load_target

    target, tok, _ = load_target(str(build_tiny_target(tmp_path / "t", hidden_size=64, num_layers=3, seed=4)))
    jobs = make_jobs(tok, 4, stdlib_fraction=0.0, seed=3)
    head = target.lm_head
    ref, _ = generate_dataset(target, tok, jobs, [0, 2], 10, batch_size=2, seed=5, progress=False)
    with driver.OnDevice(target, torch.device("cpu")) as on:
        assert isinstance(target.lm_head, torch.nn.Module) and target.lm_head is not head
        got, _ = generate_dataset(target, tok, jobs, [0, 2], 10, batch_size=2, seed=5, progress=False)
    assert target.lm_head is head and not target.model._forward_pre_hooks and on.head is head
    assert len(got) == len(ref) > 0
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
