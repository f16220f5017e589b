"""The distillation data format: round trip, append/resume, refusals, per-rank reading."""

import json

import pytest
import torch

from vllm_dflash2.train import shards

F, N = 12, 4


def _seq(seed: int, n: int = 9, prompt_len: int = 3, teacher: bool = True, kind: str = "code") -> dict:
    g = torch.Generator().manual_seed(seed)
    seq = {"tokens": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
           "feats": torch.randn(n - 1, F, generator=g).to(torch.bfloat16),
           "prompt_len": prompt_len, "kind": kind, "prompt": f"prompt {seed}"}
    if teacher:
        seq["teacher_ids"] = torch.randint(0, 100, (n - 1, N), generator=g, dtype=torch.int32)
        seq["teacher_logp"] = -torch.rand(n - 1, N, generator=g).to(torch.float16)
    return seq


HEADER = {"layer_ids": [1, 2], "feature_dim": F, "teacher_top_n": N}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k].to(b[k].dtype), b[k]), k
        else:
            assert a[k] == b[k], k


def test_round_trip_and_resume(tmp_path):
    seqs = [_seq(i, n=5 + i, prompt_len=2 + i % 3, kind=shards.KINDS[i % 2]) for i in range(7)]
    w = shards.ShardWriter(tmp_path, HEADER, {"command": "first"}, shard_sequences=3)
    for s in seqs[:5]:
        w.add(s)
    w.close(seconds=1.0)
    # A second run appends after the last complete shard.
    w = shards.ShardWriter(tmp_path, HEADER, {"command": "second"}, shard_sequences=3)
    assert w.num_sequences == 5
    for s in seqs[5:]:
        w.add(s)
    w.close()
    got, header = shards.read_shards(tmp_path)
    assert len(got) == 7
    for a, b in zip(seqs, got):
        _same(a, b)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["file"] for s in m["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert [r["command"] for r in m["runs"]] == ["first", "second"]
    assert m["totals"]["answer_tokens"] == sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
    assert header["totals"]["sequences"] == 7


def test_add_shard_writes_one_shard_of_any_size(tmp_path):
    """The Hugging Face engine settles a chunk of prompts and stores its sequences as one
    shard, more or fewer than ``shard_sequences``; the run's answer tokens count them."""
    seqs = [_seq(i, n=6 + i) for i in range(5)]
    w = shards.ShardWriter(tmp_path, HEADER, {"command": "hf"}, shard_sequences=2)
    w.add(seqs[0])
    assert w.run_answer_tokens == len(seqs[0]["tokens"]) - seqs[0]["prompt_len"]
    w.settle(7)
    w.add_shard(seqs[1:4])
    w.add_shard(seqs[4:])
    assert w.run_answer_tokens == sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
    w.close()
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["sequences"] for s in m["shards"]] == [4, 1]
    assert shards.settled_jobs(tmp_path) == {7}
    got, _ = shards.read_shards(tmp_path)
    for a, b in zip(seqs, got):
        _same(a, b)


def test_mapped_features_equal_read_ones(tmp_path):
    seqs = [_seq(i, n=6 + i) for i in range(5)]
    w = shards.ShardWriter(tmp_path, HEADER, shard_sequences=2)
    for s in seqs:
        w.add(s)
    w.close()
    mapped, _ = shards.read_shards(tmp_path, mmap=True)
    assert len(mapped) == 5
    for a, b in zip(seqs, mapped):
        _same(a, b)
        assert b["feats"].dtype == torch.bfloat16
    # A mapped shard is copy-on-write: writing into a batch never changes the file.
    mapped[0]["feats"].zero_()
    for a, b in zip(seqs, shards.read_shards(tmp_path)[0]):
        _same(a, b)


def test_ranks_read_disjoint_shards(tmp_path):
    w = shards.ShardWriter(tmp_path, HEADER, shard_sequences=2)
    for i in range(6):
        w.add(_seq(i))
    w.close()
    parts = [shards.read_shards(tmp_path, rank=r, world=2)[0] for r in range(2)]
    prompts = [[s["prompt"] for s in p] for p in parts]
    assert prompts == [["prompt 0", "prompt 1", "prompt 4", "prompt 5"], ["prompt 2", "prompt 3"]]


def test_unfinished_shard_is_ignored(tmp_path):
    w = shards.ShardWriter(tmp_path, HEADER, shard_sequences=2)
    for i in range(3):
        w.add(_seq(i))
    # Killed here: the third sequence never reached a shard; a stray temp file remains.
    (tmp_path / "shard-00001.safetensors.tmp").write_bytes(b"partial")
    got, _ = shards.read_shards(tmp_path)
    assert [s["prompt"] for s in got] == ["prompt 0", "prompt 1"]
    w2 = shards.ShardWriter(tmp_path, HEADER, shard_sequences=2)
    w2.add(_seq(9))
    w2.close()
    assert [s["prompt"] for s in shards.read_shards(tmp_path)[0]] == ["prompt 0", "prompt 1", "prompt 9"]


def test_refusals(tmp_path):
    shards.ShardWriter(tmp_path, HEADER).close()
    with pytest.raises(ValueError, match=r"layer_ids=\[1, 2\].*layer_ids=\[3\]"):
        shards.ShardWriter(tmp_path, {**HEADER, "layer_ids": [3]})
    bad = _seq(0)
    bad["feats"] = bad["feats"][:-1]
    with pytest.raises(ValueError, match="sequence 0: feats has 7 rows, expected 8"):
        shards.pack([bad])
    with pytest.raises(ValueError, match="either all carry soft labels"):
        shards.pack([_seq(0), _seq(1, teacher=False)])
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        shards.read_shards(tmp_path / "nothing")
